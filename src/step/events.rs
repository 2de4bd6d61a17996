//! A step's ownership events as one typed batch: columns an engine fills from what its scheduler
//! decided (or a binding fills from its own types), checked whole before any is applied, then
//! applied in order under as few locks as the events allow.

use crate::error::Error;
use crate::ids::{PageId, PrefixKey, RequestId, TenantId};
use crate::table::{OwnershipTable, SeqClaim};
use crate::violation::Violation;

/// What an event does: the `kinds` column of [`Events`] (its byte value in C's `kvg_event_kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum EventKind {
    /// [`OwnershipTable::admit`]: `request`, tenant in `key`, `args = [prompt_tokens, max_new_tokens]`.
    Admit = 1,
    /// [`OwnershipTable::claim`] (shadow mode): `request`, its new pages `pages[args[0]..args[1]]`.
    Claim = 2,
    /// [`OwnershipTable::release`]: `request`.
    Release = 3,
    /// [`OwnershipTable::preempt`]: `request`.
    Preempt = 4,
    /// [`OwnershipTable::publish_prefix`]: `request`, `key`, `pages[args[0]..args[1]]`.
    Publish = 5,
    /// [`OwnershipTable::attach_prefix`]: `request`, `key`.
    Attach = 6,
    /// [`OwnershipTable::detach_prefix`]: `request`, `key`.
    Detach = 7,
    /// [`OwnershipTable::evict_prefix`]: `key` (`request` is not read: an eviction takes the
    /// prefix from whoever held it).
    Evict = 8,
    /// [`OwnershipTable::release_pages`]: `request` lets go of `pages[args[0]..args[1]]` and
    /// keeps the rest (a sliding window's dropped blocks).
    ReleasePages = 9,
}

impl EventKind {
    /// The kind whose byte is `b`, if any.
    pub fn from_byte(b: u8) -> Option<EventKind> {
        Some(match b {
            1 => EventKind::Admit,
            2 => EventKind::Claim,
            3 => EventKind::Release,
            4 => EventKind::Preempt,
            5 => EventKind::Publish,
            6 => EventKind::Attach,
            7 => EventKind::Detach,
            8 => EventKind::Evict,
            9 => EventKind::ReleasePages,
            _ => return None,
        })
    }

    fn has_pages(self) -> bool {
        matches!(self, EventKind::Claim | EventKind::Publish | EventKind::ReleasePages)
    }
}

/// One ownership event, as [`Events::get`] reads it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event<'a> {
    /// A request admitted.
    Admit {
        /// The request.
        request: RequestId,
        /// Its tenant.
        tenant: TenantId,
        /// Its prompt's tokens.
        prompt_tokens: u64,
        /// The most tokens it may generate.
        max_new_tokens: u64,
    },
    /// Pages the engine's allocator gave a request.
    Claim {
        /// The request.
        request: RequestId,
        /// Its new pages.
        pages: &'a [PageId],
    },
    /// A request ended: all its pages go.
    Release {
        /// The request.
        request: RequestId,
    },
    /// A request preempted: its pages and prefix holds go, it stays admitted.
    Preempt {
        /// The request.
        request: RequestId,
    },
    /// A request's written pages cached under a prefix key.
    Publish {
        /// The publishing request.
        request: RequestId,
        /// The prefix's key.
        key: PrefixKey,
        /// The pages, in token order.
        pages: &'a [PageId],
    },
    /// A request reuses a cached prefix.
    Attach {
        /// The request.
        request: RequestId,
        /// The prefix's key.
        key: PrefixKey,
    },
    /// A request lets go of a cached prefix.
    Detach {
        /// The request.
        request: RequestId,
        /// The prefix's key.
        key: PrefixKey,
    },
    /// The cache dropped a prefix.
    Evict {
        /// The prefix's key.
        key: PrefixKey,
    },
    /// A request lets go of some of its pages.
    ReleasePages {
        /// The request.
        request: RequestId,
        /// The pages it lets go of.
        pages: &'a [PageId],
    },
}

/// Why a batch of events could not be read: nothing was applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EventsError {
    /// The columns are not all as long as `kinds`.
    #[error("the event columns differ in length: {kinds} kinds, {requests} requests, {keys} keys, {args} args")]
    Columns {
        /// Entries of `kinds`.
        kinds: usize,
        /// Entries of `requests`.
        requests: usize,
        /// Entries of `keys`.
        keys: usize,
        /// Entries of `args`.
        args: usize,
    },
    /// An event's kind byte names no [`EventKind`].
    #[error("event {index}: kind {kind} is not an event (1 admit .. 9 release_pages)")]
    Kind {
        /// The event's index.
        index: usize,
        /// Its byte.
        kind: u8,
    },
    /// An event's page range is not within the page column.
    #[error("event {index}: pages {start}..{end} are not within the {len} pages given")]
    Pages {
        /// The event's index.
        index: usize,
        /// `args[0]`.
        start: u64,
        /// `args[1]`.
        end: u64,
        /// Entries of `pages`.
        len: usize,
    },
}

/// A step's events as columns, checked: event `i` is `kinds[i]` applied to `requests[i]` with
/// `keys[i]` and `args[i]` (what each kind reads from them: [`EventKind`]), its pages (if its
/// kind has pages) `pages[args[i][0]..args[i][1]]`. Borrowed: an engine (or a binding) hands
/// the arrays it has; [`EventBatch`] builds them one event at a time.
///
/// ```
/// use kvguard::step::{Event, Events};
/// use kvguard::{PageId, RequestId};
/// let pages = [PageId(3), PageId(4)];
/// let events = Events::new(&[1, 2], &[7, 7], &[1, 0], &[[20, 8], [0, 2]], &pages)?;
/// assert!(matches!(events.get(1), Event::Claim { request: RequestId(7), pages: [PageId(3), PageId(4)] }));
/// assert!(Events::new(&[2], &[7], &[0], &[[0, 3]], &pages).is_err()); // 3 pages, 2 given
/// # Ok::<(), kvguard::step::EventsError>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct Events<'a> {
    kinds: &'a [u8],
    requests: &'a [u64],
    keys: &'a [u64],
    args: &'a [[u64; 2]],
    pages: &'a [PageId],
}

impl<'a> Events<'a> {
    /// The columns, checked whole (every length, kind and page range) before anything uses them.
    pub fn new(
        kinds: &'a [u8],
        requests: &'a [u64],
        keys: &'a [u64],
        args: &'a [[u64; 2]],
        pages: &'a [PageId],
    ) -> Result<Events<'a>, EventsError> {
        let n = kinds.len();
        if requests.len() != n || keys.len() != n || args.len() != n {
            return Err(EventsError::Columns {
                kinds: n,
                requests: requests.len(),
                keys: keys.len(),
                args: args.len(),
            });
        }
        for (index, (&b, &[start, end])) in kinds.iter().zip(args).enumerate() {
            let kind = EventKind::from_byte(b).ok_or(EventsError::Kind { index, kind: b })?;
            if kind.has_pages() && (start > end || end > pages.len() as u64) {
                return Err(EventsError::Pages { index, start, end, len: pages.len() });
            }
        }
        Ok(Events { kinds, requests, keys, args, pages })
    }

    /// No events.
    pub fn none() -> Events<'static> {
        Events::default()
    }

    /// How many events.
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// Event `i`'s kind (`i < len()`).
    pub fn kind(&self, i: usize) -> EventKind {
        EventKind::from_byte(self.kinds[i]).unwrap_or(EventKind::Evict)
    }

    /// Event `i`'s `requests` entry (`i < len()`).
    pub fn request(&self, i: usize) -> RequestId {
        RequestId(self.requests[i])
    }

    /// Event `i`'s request and pages, as a claim reads them (`kind(i)` is a claim).
    fn claim_at(&self, i: usize) -> SeqClaim<'a> {
        let [a, b] = self.args[i];
        SeqClaim { request: RequestId(self.requests[i]), pages: &self.pages[a as usize..b as usize] }
    }

    /// Event `i` (`i < len()`).
    pub fn get(&self, i: usize) -> Event<'a> {
        let request = RequestId(self.requests[i]);
        let key = PrefixKey(self.keys[i]);
        let [a, b] = self.args[i];
        let pages = || if self.kind(i).has_pages() { &self.pages[a as usize..b as usize] } else { &[][..] };
        match self.kind(i) {
            EventKind::Admit => {
                Event::Admit { request, tenant: TenantId(self.keys[i]), prompt_tokens: a, max_new_tokens: b }
            }
            EventKind::Claim => Event::Claim { request, pages: pages() },
            EventKind::Release => Event::Release { request },
            EventKind::Preempt => Event::Preempt { request },
            EventKind::Publish => Event::Publish { request, key, pages: pages() },
            EventKind::Attach => Event::Attach { request, key },
            EventKind::Detach => Event::Detach { request, key },
            EventKind::Evict => Event::Evict { key },
            EventKind::ReleasePages => Event::ReleasePages { request, pages: pages() },
        }
    }
}

/// A step's events built one at a time into [`Events`]' columns (kept across steps, cleared
/// between them, it allocates nothing once warm).
///
/// ```
/// use kvguard::step::EventBatch;
/// use kvguard::{OwnershipTable, PageId, PoolConfig, PrefixKey, RequestId, TenantId};
/// let table = OwnershipTable::new(PoolConfig::new(64, 16, 512))?;
/// let mut batch = EventBatch::new();
/// batch.admit(RequestId(1), TenantId(1), 20, 4).claim(RequestId(1), &[PageId(3), PageId(4)]);
/// let applied = table.apply_events(batch.events());
/// assert!(applied.refused.is_empty() && applied.failed.is_none());
/// assert_eq!(table.request_info(RequestId(1)).unwrap().owned_pages.len(), 2);
/// # Ok::<(), kvguard::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct EventBatch {
    kinds: Vec<u8>,
    requests: Vec<u64>,
    keys: Vec<u64>,
    args: Vec<[u64; 2]>,
    pages: Vec<PageId>,
}

impl EventBatch {
    /// An empty batch.
    pub fn new() -> EventBatch {
        EventBatch::default()
    }

    /// An empty batch with room for `events` events naming `pages` pages in all, so that
    /// filling it reallocates nothing (a step's events, counted before they are read).
    pub fn with_capacity(events: usize, pages: usize) -> EventBatch {
        EventBatch {
            kinds: Vec::with_capacity(events),
            requests: Vec::with_capacity(events),
            keys: Vec::with_capacity(events),
            args: Vec::with_capacity(events),
            pages: Vec::with_capacity(pages),
        }
    }

    /// Room for `events` more events naming `pages` more pages, so that filling it reallocates
    /// nothing.
    pub fn reserve(&mut self, events: usize, pages: usize) {
        self.kinds.reserve(events);
        self.requests.reserve(events);
        self.keys.reserve(events);
        self.args.reserve(events);
        self.pages.reserve(pages);
    }

    /// Forgets every event (keeps the memory).
    pub fn clear(&mut self) {
        self.kinds.clear();
        self.requests.clear();
        self.keys.clear();
        self.args.clear();
        self.pages.clear();
    }

    /// How many events.
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// The events as columns.
    pub fn events(&self) -> Events<'_> {
        // Built one checked event at a time: the columns are whole.
        Events { kinds: &self.kinds, requests: &self.requests, keys: &self.keys, args: &self.args, pages: &self.pages }
    }

    /// Appends `event`.
    pub fn push(&mut self, event: Event<'_>) -> &mut Self {
        let (kind, request, key, args, pages): (EventKind, RequestId, u64, [u64; 2], &[PageId]) = match event {
            Event::Admit { request, tenant, prompt_tokens, max_new_tokens } => {
                (EventKind::Admit, request, tenant.0, [prompt_tokens, max_new_tokens], &[])
            }
            Event::Claim { request, pages } => (EventKind::Claim, request, 0, [0; 2], pages),
            Event::Release { request } => (EventKind::Release, request, 0, [0; 2], &[]),
            Event::Preempt { request } => (EventKind::Preempt, request, 0, [0; 2], &[]),
            Event::Publish { request, key, pages } => (EventKind::Publish, request, key.0, [0; 2], pages),
            Event::Attach { request, key } => (EventKind::Attach, request, key.0, [0; 2], &[]),
            Event::Detach { request, key } => (EventKind::Detach, request, key.0, [0; 2], &[]),
            Event::Evict { key } => (EventKind::Evict, RequestId(0), key.0, [0; 2], &[]),
            Event::ReleasePages { request, pages } => (EventKind::ReleasePages, request, 0, [0; 2], pages),
        };
        let args = if kind.has_pages() {
            let start = self.pages.len() as u64;
            self.pages.extend_from_slice(pages);
            [start, self.pages.len() as u64]
        } else {
            args
        };
        self.kinds.push(kind as u8);
        self.requests.push(request.0);
        self.keys.push(key);
        self.args.push(args);
        self
    }

    /// Appends an admission.
    pub fn admit(
        &mut self,
        request: RequestId,
        tenant: TenantId,
        prompt_tokens: u64,
        max_new_tokens: u64,
    ) -> &mut Self {
        self.push(Event::Admit { request, tenant, prompt_tokens, max_new_tokens })
    }

    /// Appends a claim.
    pub fn claim(&mut self, request: RequestId, pages: &[PageId]) -> &mut Self {
        self.push(Event::Claim { request, pages })
    }

    /// Appends a release.
    pub fn release(&mut self, request: RequestId) -> &mut Self {
        self.push(Event::Release { request })
    }

    /// Appends a preemption.
    pub fn preempt(&mut self, request: RequestId) -> &mut Self {
        self.push(Event::Preempt { request })
    }

    /// Appends a publish.
    pub fn publish(&mut self, request: RequestId, key: PrefixKey, pages: &[PageId]) -> &mut Self {
        self.push(Event::Publish { request, key, pages })
    }

    /// Appends an attach.
    pub fn attach(&mut self, request: RequestId, key: PrefixKey) -> &mut Self {
        self.push(Event::Attach { request, key })
    }

    /// Appends a detach.
    pub fn detach(&mut self, request: RequestId, key: PrefixKey) -> &mut Self {
        self.push(Event::Detach { request, key })
    }

    /// Appends an eviction.
    pub fn evict(&mut self, key: PrefixKey) -> &mut Self {
        self.push(Event::Evict { key })
    }

    /// Appends a partial release.
    pub fn release_pages(&mut self, request: RequestId, pages: &[PageId]) -> &mut Self {
        self.push(Event::ReleasePages { request, pages })
    }
}

/// What applying a batch did: the refused events (each judged: counted, logged, under enforce
/// its request quarantined, as the single call would), and the event that failed with an error
/// that is not a violation, if one did (say [`Error::OutOfPages`]): it and the events after it
/// were not applied; those before it were.
#[derive(Debug, Default)]
#[must_use]
pub struct AppliedEvents {
    /// `(index, violation)` of each refused event, in order.
    pub refused: Vec<(usize, Violation)>,
    /// `(index, error)` of the event that stopped the batch.
    pub failed: Option<(usize, Error)>,
}

impl AppliedEvents {
    /// Whether every event was applied (refused or not): nothing stopped the batch.
    pub fn completed(&self) -> bool {
        self.failed.is_none()
    }
}

impl OwnershipTable {
    /// Applies a step's events in order, each judged as its single call
    /// ([`admit`](Self::admit), [`claim`](Self::claim), ...) judges it; a run of consecutive
    /// claims goes through [`claim_step`](Self::claim_step) under one lock. A refused event
    /// changes nothing and the next is applied; an error that is not a violation stops the batch
    /// there ([`AppliedEvents::failed`]).
    pub fn apply_events(&self, events: Events<'_>) -> AppliedEvents {
        let mut out = AppliedEvents::default();
        let mut i = 0;
        while i < events.len() {
            if events.kind(i) == EventKind::Claim {
                let start = i;
                while i < events.len() && events.kind(i) == EventKind::Claim {
                    i += 1;
                }
                // The run's claims as they are applied, not listed first.
                let verdict = self.claims_by(i - start, |k| events.claim_at(start + k));
                out.refused.extend(verdict.refused.into_iter().map(|(k, v)| (start + k, v)));
                continue;
            }
            let outcome = match events.get(i) {
                Event::Admit { request, tenant, prompt_tokens, max_new_tokens } => {
                    self.admit(request, tenant, prompt_tokens, max_new_tokens)
                }
                Event::Claim { .. } => Ok(()), // runs of claims are taken above
                Event::Release { request } => self.release(request).map(drop),
                Event::Preempt { request } => self.preempt(request).map(drop),
                Event::Publish { request, key, pages } => self.publish_prefix(request, key, pages),
                Event::Attach { request, key } => self.attach_prefix(request, key).map(drop),
                Event::Detach { request, key } => self.detach_prefix(request, key).map(drop),
                Event::Evict { key } => self.evict_prefix(key).map(drop),
                Event::ReleasePages { request, pages } => self.release_pages(request, pages).map(drop),
            };
            match outcome {
                Ok(()) => {}
                Err(Error::Violation(v)) => out.refused.push((i, v)),
                Err(e) => {
                    out.failed = Some((i, e));
                    return out;
                }
            }
            i += 1;
        }
        out
    }
}
