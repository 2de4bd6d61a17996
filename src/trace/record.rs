//! Recording: trace lines (v1.1) written, buffered, from an engine's run, for replay later.

use super::error::{ReplayError, ReplayErrorKind};
use super::event::{Event, EventKind};
use crate::config::PoolConfig;
use crate::error::Error;
use crate::ids::{PageId, PageRef, PrefixKey, RequestId, TenantId};
use crate::table::OwnershipTable;
use parking_lot::Mutex;
use std::borrow::Cow;
use std::io::{self, BufWriter, Write};

/// Writes trace lines (v1.1: the pool line declares it, [`into_inner`](Self::into_inner) ends it), buffered (64 KiB), to any writer.
///
/// An engine calls it beside its own allocator, event by event; [`RecordingTable`] calls it for
/// an engine that already drives an [`OwnershipTable`]. Lines are written in call order; call
/// [`flush`](Self::flush) (or drop the recorder) before replaying what it wrote.
///
/// It keeps the order a [`Replayer`](super::Replayer) requires: an event before the `pool` event,
/// a second `pool` event, or an event after the `end` event is refused, nothing written, with an
/// [`io::ErrorKind::InvalidInput`] error whose inner error is the [`ReplayError`] replay would
/// give that line ([`ReplayErrorKind::BeforePool`], [`SecondPool`](ReplayErrorKind::SecondPool),
/// [`AfterEnd`](ReplayErrorKind::AfterEnd)).
///
/// ```
/// use kvguard::trace::Recorder;
/// use kvguard::{PageId, PoolConfig, RequestId};
/// let mut rec = Recorder::new(Vec::new());
/// rec.pool(&PoolConfig::new(64, 16, 512).with_reserved([PageId(0)]))?;
/// rec.admit(RequestId(1), "acme", 20, 8)?;
/// rec.alloc(RequestId(1), &[PageId(5), PageId(6)])?;
/// let out = String::from_utf8(rec.into_inner()?).unwrap();
/// assert_eq!(out.lines().nth(2), Some(r#"{"ev":"alloc","req":1,"pages":[5,6]}"#));
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Debug)]
pub struct Recorder<W: Write> {
    out: BufWriter<W>,
    events: u64,
    /// Lines written (events and comments): the next line's number is one more.
    lines: u64,
    pooled: bool,
    ended: bool,
}

impl<W: Write> Recorder<W> {
    /// A recorder writing to `writer`.
    pub fn new(writer: W) -> Recorder<W> {
        Recorder { out: BufWriter::with_capacity(64 << 10, writer), events: 0, lines: 0, pooled: false, ended: false }
    }

    /// Writes one event as one line; an event out of the trace's order (see [`Recorder`]) is
    /// refused, nothing written.
    pub fn event(&mut self, event: &Event<'_>) -> io::Result<()> {
        let kind = event.kind();
        self.check_order(kind)?;
        serde_json::to_writer(&mut self.out, event).map_err(io::Error::other)?;
        self.out.write_all(b"\n")?;
        self.events += 1;
        self.lines += 1;
        self.pooled |= kind == EventKind::Pool;
        self.ended |= kind == EventKind::End;
        Ok(())
    }

    /// Whether an event of `kind` may come next: the replayer's order (one `pool` event first,
    /// nothing after `end`), refused as the replayer would refuse that line.
    fn check_order(&self, kind: EventKind) -> io::Result<()> {
        let refused = match (self.ended, kind, self.pooled) {
            (true, ..) => ReplayErrorKind::AfterEnd(kind.as_str()),
            (false, EventKind::Pool, true) => ReplayErrorKind::SecondPool,
            (false, EventKind::Pool, false) | (false, _, true) => return Ok(()),
            (false, other, false) => ReplayErrorKind::BeforePool(other.as_str()),
        };
        Err(io::Error::new(io::ErrorKind::InvalidInput, ReplayError::new(self.lines + 1, refused)))
    }

    /// Writes a `#` comment line (newlines in `text` become spaces).
    pub fn comment(&mut self, text: &str) -> io::Result<()> {
        self.out.write_all(b"# ")?;
        self.out.write_all(text.replace(['\n', '\r'], " ").as_bytes())?;
        self.out.write_all(b"\n")?;
        self.lines += 1;
        Ok(())
    }

    /// Events written so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// The `pool` event for `config` (its policy and scrubbing are not part of v1).
    pub fn pool(&mut self, config: &PoolConfig) -> io::Result<()> {
        self.event(&Event::Pool {
            pages: config.num_pages,
            page_size: config.page_size,
            max_context: config.max_context_tokens,
            reserved: Cow::Borrowed(&config.reserved[..]),
            version: Some(Cow::Borrowed("1.1")),
            scrub_on_release: config.scrub_on_release,
        })
    }

    /// `req` starts for `tenant`.
    pub fn admit(&mut self, req: RequestId, tenant: &str, prompt: u64, max_new: u64) -> io::Result<()> {
        self.event(&Event::Admit { req, tenant: Cow::Borrowed(tenant), prompt, max_new })
    }

    /// The engine gave `req` these pages.
    pub fn alloc(&mut self, req: RequestId, pages: &[PageId]) -> io::Result<()> {
        self.event(&Event::Alloc { req, pages: Cow::Borrowed(pages) })
    }

    /// `req` wrote slots `a..b` of `page`.
    pub fn write(&mut self, req: RequestId, page: PageId, a: u32, b: u32) -> io::Result<()> {
        self.event(&Event::Write { req, page, slots: [a, b] })
    }

    /// `req` read its first `tokens` tokens through `pages`.
    pub fn read(&mut self, req: RequestId, pages: &[PageId], tokens: u64) -> io::Result<()> {
        self.event(&Event::Read { req, pages: Cow::Borrowed(pages), tokens })
    }

    /// `req` ended.
    pub fn free(&mut self, req: RequestId) -> io::Result<()> {
        self.event(&Event::Free { req, pages: None })
    }

    /// `req` released just `pages`.
    pub fn free_pages(&mut self, req: RequestId, pages: &[PageId]) -> io::Result<()> {
        self.event(&Event::Free { req, pages: Some(Cow::Borrowed(pages)) })
    }

    /// `req`'s `pages` became prefix `key`.
    pub fn share(&mut self, req: RequestId, key: &str, pages: &[PageId]) -> io::Result<()> {
        self.event(&Event::Share { req, key: Cow::Borrowed(key), pages: Cow::Borrowed(pages) })
    }

    /// `req` holds prefix `key`.
    pub fn attach(&mut self, req: RequestId, key: &str) -> io::Result<()> {
        self.event(&Event::Attach { req, key: Cow::Borrowed(key) })
    }

    /// The cache dropped prefix `key`.
    pub fn evict(&mut self, key: &str) -> io::Result<()> {
        self.event(&Event::Evict { key: Cow::Borrowed(key) })
    }

    /// A transfer wrote `tokens` tokens into `req`'s `pages`, which expected `expect`.
    pub fn import(&mut self, req: RequestId, pages: &[PageId], tokens: u64, expect: u64) -> io::Result<()> {
        self.event(&Event::Import { req, pages: Cow::Borrowed(pages), tokens, expect })
    }

    /// `child` forked from `req`.
    pub fn fork(&mut self, req: RequestId, child: RequestId) -> io::Result<()> {
        self.event(&Event::Fork { req, child })
    }

    /// v1.1: `req` let go of prefix `key`.
    pub fn detach(&mut self, req: RequestId, key: &str) -> io::Result<()> {
        self.event(&Event::Detach { req, key: Cow::Borrowed(key) })
    }

    /// v1.1: `req` was preempted (pages and prefix holds released, still admitted).
    pub fn preempt(&mut self, req: RequestId) -> io::Result<()> {
        self.event(&Event::Preempt { req })
    }

    /// v1.1: the engine poisoned or zeroed these released pages.
    pub fn scrub(&mut self, pages: &[PageId]) -> io::Result<()> {
        self.event(&Event::Scrub { pages: Cow::Borrowed(pages) })
    }

    /// v1.1: other tenants may (`allow`) or may no longer attach to `tenant`'s prefixes.
    pub fn grant(&mut self, tenant: &str, allow: bool) -> io::Result<()> {
        let tenant = Cow::Borrowed(tenant);
        self.event(&if allow { Event::Grant { tenant } } else { Event::Revoke { tenant } })
    }

    /// v1.1: writes the end marker (once; [`into_inner`](Self::into_inner) writes it if this was
    /// not called). A recording the engine never finished lacks it, and replay calls it truncated.
    /// Before the `pool` event it is refused, as any event is.
    pub fn end(&mut self) -> io::Result<()> {
        if !self.ended {
            self.event(&Event::End)?;
        }
        Ok(())
    }

    /// Writes out what is buffered.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// Ends the recording (the end marker), flushes, and hands the writer back. A recorder
    /// dropped without this flushes what it wrote but no end marker: the trace reads as
    /// truncated, as it should. A recorder that wrote no `pool` event gets no end marker either
    /// (replay calls its trace one without a pool).
    pub fn into_inner(mut self) -> io::Result<W> {
        if self.pooled {
            self.end()?;
        }
        self.out.into_inner().map_err(|e| e.into_error())
    }
}

/// An [`OwnershipTable`] in shadow mode whose every call is also recorded as a trace event, so the
/// run can be replayed later with the same verdicts.
///
/// The event is written before the table judges the call, refused calls included, under one lock
/// so the trace's order is the table's order. Tenants are written as their decimal id, prefix
/// keys as `0x` and their hex value. Replay gives the same verdicts up to the first violation
/// (build the table with [`Policy::Report`](crate::Policy::Report): replay never quarantines);
/// after it, replay follows the engine, which went ahead with the call the table refused. A failed write to the
/// trace does not fail the engine's call: it is kept and returned by [`finish`](Self::finish),
/// and nothing more is recorded after it.
///
/// Traces are written as v1.1 (the pool line says `"version":"1.1"`): [`finish`](Self::finish)
/// writes the end marker, so a recording cut short reads as truncated.
#[derive(Debug)]
pub struct RecordingTable<'t, W: Write> {
    table: &'t OwnershipTable,
    recorder: Mutex<(Recorder<W>, Option<io::Error>)>,
}

impl<'t, W: Write> RecordingTable<'t, W> {
    /// Records `table`'s calls to `writer`, starting with the pool event.
    pub fn new(table: &'t OwnershipTable, writer: W) -> io::Result<RecordingTable<'t, W>> {
        let mut recorder = Recorder::new(writer);
        recorder.pool(table.config())?;
        Ok(RecordingTable { table, recorder: Mutex::new((recorder, None)) })
    }

    /// The table.
    pub fn table(&self) -> &'t OwnershipTable {
        self.table
    }

    /// Records `event`, then runs `call` under the same lock.
    fn with<T>(&self, event: Event<'_>, call: impl FnOnce(&OwnershipTable) -> T) -> T {
        let mut guard = self.recorder.lock();
        let (recorder, failed) = &mut *guard;
        if failed.is_none()
            && let Err(e) = recorder.event(&event)
        {
            *failed = Some(e);
        }
        call(self.table)
    }

    /// [`OwnershipTable::admit`]; the tenant is recorded as its decimal id.
    pub fn admit(&self, req: RequestId, tenant: TenantId, prompt: u64, max_new: u64) -> Result<(), Error> {
        let name = tenant.0.to_string();
        self.with(Event::Admit { req, tenant: name.into(), prompt, max_new }, |t| t.admit(req, tenant, prompt, max_new))
    }

    /// [`OwnershipTable::claim`], recorded as `alloc`.
    pub fn claim(&self, req: RequestId, pages: &[PageId]) -> Result<(), Error> {
        self.with(Event::Alloc { req, pages: pages.into() }, |t| t.claim(req, pages).map(drop))
    }

    /// [`OwnershipTable::record_write`].
    pub fn record_write(&self, req: RequestId, page: PageId, a: u32, b: u32) -> Result<(), Error> {
        self.with(Event::Write { req, page, slots: [a, b] }, |t| t.record_write(req, page, a..b))
    }

    /// [`OwnershipTable::verify_read`].
    pub fn verify_read(&self, req: RequestId, pages: &[PageId], tokens: u64) -> Result<(), Error> {
        self.with(Event::Read { req, pages: pages.into(), tokens }, |t| t.verify_read(req, pages, tokens))
    }

    /// [`OwnershipTable::release`], recorded as `free`.
    pub fn release(&self, req: RequestId) -> Result<(), Error> {
        self.with(Event::Free { req, pages: None }, |t| t.release(req).map(drop))
    }

    /// [`OwnershipTable::release_pages`], recorded as `free` with pages.
    pub fn release_pages(&self, req: RequestId, pages: &[PageId]) -> Result<(), Error> {
        self.with(Event::Free { req, pages: Some(pages.into()) }, |t| t.release_pages(req, pages).map(drop))
    }

    /// [`OwnershipTable::publish_prefix`], recorded as `share`.
    pub fn publish_prefix(&self, req: RequestId, key: PrefixKey, pages: &[PageId]) -> Result<(), Error> {
        let name = key_name(key);
        self.with(Event::Share { req, key: name.into(), pages: pages.into() }, |t| t.publish_prefix(req, key, pages))
    }

    /// [`OwnershipTable::attach_prefix`], recorded as `attach`.
    pub fn attach_prefix(&self, req: RequestId, key: PrefixKey) -> Result<(), Error> {
        self.with(Event::Attach { req, key: key_name(key).into() }, |t| t.attach_prefix(req, key).map(drop))
    }

    /// [`OwnershipTable::evict_prefix`], recorded as `evict`.
    pub fn evict_prefix(&self, key: PrefixKey) -> Result<(), Error> {
        self.with(Event::Evict { key: key_name(key).into() }, |t| t.evict_prefix(key).map(drop))
    }

    /// [`OwnershipTable::record_import`], recorded as `import`.
    pub fn record_import(&self, req: RequestId, pages: &[PageId], tokens: u64, expect: u64) -> Result<(), Error> {
        self.with(Event::Import { req, pages: pages.into(), tokens, expect }, |t| {
            t.record_import(req, pages, tokens, expect)
        })
    }

    /// [`OwnershipTable::fork`].
    pub fn fork(&self, req: RequestId, child: RequestId) -> Result<(), Error> {
        self.with(Event::Fork { req, child }, |t| t.fork(req, child))
    }

    /// [`OwnershipTable::detach_prefix`], recorded as `detach` (v1.1).
    pub fn detach_prefix(&self, req: RequestId, key: PrefixKey) -> Result<(), Error> {
        self.with(Event::Detach { req, key: key_name(key).into() }, |t| t.detach_prefix(req, key).map(drop))
    }

    /// [`OwnershipTable::preempt`], recorded as `preempt` (v1.1).
    pub fn preempt(&self, req: RequestId) -> Result<(), Error> {
        self.with(Event::Preempt { req }, |t| t.preempt(req).map(drop))
    }

    /// [`OwnershipTable::confirm_scrubbed`], recorded as `scrub` (v1.1) with the page ids.
    pub fn confirm_scrubbed(&self, pages: &[PageRef]) -> Result<(), Error> {
        let ids: Vec<PageId> = pages.iter().map(|r| r.page).collect();
        self.with(Event::Scrub { pages: ids.into() }, |t| t.confirm_scrubbed(pages))
    }

    /// [`OwnershipTable::allow_cross_tenant_sharing`], recorded as `grant` or `revoke` (v1.1).
    pub fn allow_cross_tenant_sharing(&self, tenant: TenantId, allow: bool) {
        let name: Cow<'_, str> = tenant.0.to_string().into();
        let event = if allow { Event::Grant { tenant: name } } else { Event::Revoke { tenant: name } };
        self.with(event, |t| t.allow_cross_tenant_sharing(tenant, allow))
    }

    /// Writes the end marker, flushes the trace and hands the writer back, or the first write
    /// error.
    pub fn finish(self) -> io::Result<W> {
        let (recorder, failed) = self.recorder.into_inner();
        match failed {
            Some(e) => Err(e),
            None => recorder.into_inner(),
        }
    }
}

fn key_name(key: PrefixKey) -> String {
    format!("{:#x}", key.0)
}
