//! The trace events (v1, and the v1.1 additions): what an engine's scheduler did to its KV pool,
//! one JSON object per line.

use crate::ids::{PageId, RequestId};
use serde::Serialize;
use std::borrow::Cow;
use std::fmt;

/// One trace event (v1, or one of the v1.1 additions), borrowing its strings and page lists (from a parsed line, or from the
/// engine's own buffers when recording).
///
/// Serializes to exactly one v1 line (`ev` first), and deserializes from one with the format's
/// rules (unknown fields ignored, whatever their type; page ids beyond `u32` read as `u32::MAX`):
/// ```
/// use kvguard::trace::Event;
/// use kvguard::{PageId, RequestId};
/// let ev = Event::Alloc { req: RequestId(7), pages: vec![PageId(3), PageId(4)].into() };
/// let line = serde_json::to_string(&ev)?;
/// assert_eq!(line, r#"{"ev":"alloc","req":7,"pages":[3,4]}"#);
/// assert_eq!(serde_json::from_str::<Event>(&line)?, ev);
/// assert!(serde_json::from_str::<Event>(r#"{"ev":"alloc","req":-7,"pages":[]}"#).is_err());
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Event<'a> {
    /// The pool: first event, exactly once.
    Pool {
        /// Pages in the pool, ids `0..pages`.
        pages: u32,
        /// Token slots per page.
        page_size: u32,
        /// The most tokens one request may have.
        max_context: u64,
        /// Pages never allocated and never readable (the null page).
        #[serde(skip_serializing_if = "<[PageId]>::is_empty")]
        reserved: Cow<'a, [PageId]>,
        /// v1.1: the format version the recorder wrote (`"1.1"`); a trace that declares 1.1
        /// must end with an [`Event::End`], or it is truncated. `None` for v1.
        #[serde(skip_serializing_if = "Option::is_none")]
        version: Option<Cow<'a, str>>,
        /// v1.1: released pages await a [`Event::Scrub`] before they can be allocated again.
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        scrub_on_release: bool,
    },
    /// A request starts.
    Admit {
        /// The request.
        req: RequestId,
        /// Whose data it is.
        tenant: Cow<'a, str>,
        /// Prompt tokens.
        prompt: u64,
        /// New tokens it may generate.
        max_new: u64,
    },
    /// The engine gave `req` these pages, appended to its block table.
    Alloc {
        /// The request.
        req: RequestId,
        /// The pages.
        pages: Cow<'a, [PageId]>,
    },
    /// `req`'s KV store wrote slots `slots[0]..slots[1]` of `page`.
    Write {
        /// The request.
        req: RequestId,
        /// The page.
        page: PageId,
        /// Half-open slot range `[a,b]`.
        slots: [u32; 2],
    },
    /// `req`'s attention read its first `tokens` tokens through `pages`, in order.
    Read {
        /// The request.
        req: RequestId,
        /// Its block table.
        pages: Cow<'a, [PageId]>,
        /// Tokens read.
        tokens: u64,
    },
    /// `req` ended (no `pages`), or released just `pages`.
    Free {
        /// The request.
        req: RequestId,
        /// The pages released, or `None` when the request ended.
        #[serde(skip_serializing_if = "Option::is_none")]
        pages: Option<Cow<'a, [PageId]>>,
    },
    /// `req`'s `pages` become the read-only prefix `key`, which `req` holds.
    Share {
        /// The request.
        req: RequestId,
        /// The prefix key.
        key: Cow<'a, str>,
        /// The pages.
        pages: Cow<'a, [PageId]>,
    },
    /// `req` holds prefix `key` and may read its pages.
    Attach {
        /// The request.
        req: RequestId,
        /// The prefix key.
        key: Cow<'a, str>,
    },
    /// The cache drops prefix `key`.
    Evict {
        /// The prefix key.
        key: Cow<'a, str>,
    },
    /// A KV transfer wrote `tokens` tokens into `req`'s `pages`, which expected `expect`.
    Import {
        /// The request.
        req: RequestId,
        /// The pages, filled from the first slot of the first page.
        pages: Cow<'a, [PageId]>,
        /// Tokens the transfer carried.
        tokens: u64,
        /// Tokens `req` expected.
        expect: u64,
    },
    /// `child` is admitted for `req`'s tenant, holding `req`'s pages read-only.
    Fork {
        /// The parent.
        req: RequestId,
        /// The child.
        child: RequestId,
    },
    /// v1.1: `req` lets go of prefix `key` and stays admitted.
    Detach {
        /// The request.
        req: RequestId,
        /// The prefix key.
        key: Cow<'a, str>,
    },
    /// v1.1: `req` is preempted: its pages are released and its prefix holds dropped, but it
    /// stays admitted (it will be given pages again and recompute).
    Preempt {
        /// The request.
        req: RequestId,
    },
    /// v1.1: the engine poisoned or zeroed these released pages (their old KV is gone).
    Scrub {
        /// The pages.
        pages: Cow<'a, [PageId]>,
    },
    /// v1.1: other tenants may attach to `tenant`'s prefixes from now on.
    Grant {
        /// The tenant that shares.
        tenant: Cow<'a, str>,
    },
    /// v1.1: a [`Event::Grant`] withdrawn (holds already taken stay).
    Revoke {
        /// The tenant.
        tenant: Cow<'a, str>,
    },
    /// v1.1: the recording ended here, complete. Nothing may follow it.
    End,
}

impl Event<'_> {
    /// Which event this is.
    pub fn kind(&self) -> EventKind {
        match self {
            Event::Pool { .. } => EventKind::Pool,
            Event::Admit { .. } => EventKind::Admit,
            Event::Alloc { .. } => EventKind::Alloc,
            Event::Write { .. } => EventKind::Write,
            Event::Read { .. } => EventKind::Read,
            Event::Free { .. } => EventKind::Free,
            Event::Share { .. } => EventKind::Share,
            Event::Attach { .. } => EventKind::Attach,
            Event::Evict { .. } => EventKind::Evict,
            Event::Import { .. } => EventKind::Import,
            Event::Fork { .. } => EventKind::Fork,
            Event::Detach { .. } => EventKind::Detach,
            Event::Preempt { .. } => EventKind::Preempt,
            Event::Scrub { .. } => EventKind::Scrub,
            Event::Grant { .. } => EventKind::Grant,
            Event::Revoke { .. } => EventKind::Revoke,
            Event::End => EventKind::End,
        }
    }

    /// The same event, owning its strings and page lists.
    pub fn into_owned(self) -> Event<'static> {
        fn own<T: Clone>(c: Cow<'_, [T]>) -> Cow<'static, [T]> {
            Cow::Owned(c.into_owned())
        }
        fn text(c: Cow<'_, str>) -> Cow<'static, str> {
            Cow::Owned(c.into_owned())
        }
        match self {
            Event::Pool { pages, page_size, max_context, reserved, version, scrub_on_release } => Event::Pool {
                pages,
                page_size,
                max_context,
                reserved: own(reserved),
                version: version.map(text),
                scrub_on_release,
            },
            Event::Admit { req, tenant, prompt, max_new } => {
                Event::Admit { req, tenant: text(tenant), prompt, max_new }
            }
            Event::Alloc { req, pages } => Event::Alloc { req, pages: own(pages) },
            Event::Write { req, page, slots } => Event::Write { req, page, slots },
            Event::Read { req, pages, tokens } => Event::Read { req, pages: own(pages), tokens },
            Event::Free { req, pages } => Event::Free { req, pages: pages.map(own) },
            Event::Share { req, key, pages } => Event::Share { req, key: text(key), pages: own(pages) },
            Event::Attach { req, key } => Event::Attach { req, key: text(key) },
            Event::Evict { key } => Event::Evict { key: text(key) },
            Event::Import { req, pages, tokens, expect } => Event::Import { req, pages: own(pages), tokens, expect },
            Event::Fork { req, child } => Event::Fork { req, child },
            Event::Detach { req, key } => Event::Detach { req, key: text(key) },
            Event::Preempt { req } => Event::Preempt { req },
            Event::Scrub { pages } => Event::Scrub { pages: own(pages) },
            Event::Grant { tenant } => Event::Grant { tenant: text(tenant) },
            Event::Revoke { tenant } => Event::Revoke { tenant: text(tenant) },
            Event::End => Event::End,
        }
    }

    /// The prefix key the event names, if any.
    pub fn key(&self) -> Option<&str> {
        match self {
            Event::Share { key, .. } | Event::Attach { key, .. } | Event::Evict { key } | Event::Detach { key, .. } => {
                Some(key)
            }
            _ => None,
        }
    }
}

/// The name of an event (the `ev` field).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[non_exhaustive]
pub enum EventKind {
    /// `pool`
    Pool,
    /// `admit`
    Admit,
    /// `alloc`
    Alloc,
    /// `write`
    Write,
    /// `read`
    Read,
    /// `free`
    Free,
    /// `share`
    Share,
    /// `attach`
    Attach,
    /// `evict`
    Evict,
    /// `import`
    Import,
    /// `fork`
    Fork,
    /// `detach` (v1.1)
    Detach,
    /// `preempt` (v1.1)
    Preempt,
    /// `scrub` (v1.1)
    Scrub,
    /// `grant` (v1.1)
    Grant,
    /// `revoke` (v1.1)
    Revoke,
    /// `end` (v1.1)
    End,
}

impl EventKind {
    /// Whether the event is one of the v1.1 additions.
    pub fn is_v1_1(self) -> bool {
        matches!(
            self,
            EventKind::Detach
                | EventKind::Preempt
                | EventKind::Scrub
                | EventKind::Grant
                | EventKind::Revoke
                | EventKind::End
        )
    }

    /// Every event, in the order the format lists them (v1, then v1.1).
    pub const ALL: &'static [EventKind] = &[
        EventKind::Pool,
        EventKind::Admit,
        EventKind::Alloc,
        EventKind::Write,
        EventKind::Read,
        EventKind::Free,
        EventKind::Share,
        EventKind::Attach,
        EventKind::Evict,
        EventKind::Import,
        EventKind::Fork,
        EventKind::Detach,
        EventKind::Preempt,
        EventKind::Scrub,
        EventKind::Grant,
        EventKind::Revoke,
        EventKind::End,
    ];

    /// The `ev` string.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Pool => "pool",
            EventKind::Admit => "admit",
            EventKind::Alloc => "alloc",
            EventKind::Write => "write",
            EventKind::Read => "read",
            EventKind::Free => "free",
            EventKind::Share => "share",
            EventKind::Attach => "attach",
            EventKind::Evict => "evict",
            EventKind::Import => "import",
            EventKind::Fork => "fork",
            EventKind::Detach => "detach",
            EventKind::Preempt => "preempt",
            EventKind::Scrub => "scrub",
            EventKind::Grant => "grant",
            EventKind::Revoke => "revoke",
            EventKind::End => "end",
        }
    }

    /// The event named `name`, if the format (v1 or v1.1) has one.
    pub fn from_name(name: &str) -> Option<EventKind> {
        EventKind::from_bytes(name.as_bytes())
    }

    /// [`EventKind::from_name`] of a name's bytes (the parser's fast path has them before any
    /// UTF-8 check).
    pub(crate) fn from_bytes(name: &[u8]) -> Option<EventKind> {
        Some(match name {
            b"pool" => EventKind::Pool,
            b"admit" => EventKind::Admit,
            b"alloc" => EventKind::Alloc,
            b"write" => EventKind::Write,
            b"read" => EventKind::Read,
            b"free" => EventKind::Free,
            b"share" => EventKind::Share,
            b"attach" => EventKind::Attach,
            b"evict" => EventKind::Evict,
            b"import" => EventKind::Import,
            b"fork" => EventKind::Fork,
            b"detach" => EventKind::Detach,
            b"preempt" => EventKind::Preempt,
            b"scrub" => EventKind::Scrub,
            b"grant" => EventKind::Grant,
            b"revoke" => EventKind::Revoke,
            b"end" => EventKind::End,
            _ => return None,
        })
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
