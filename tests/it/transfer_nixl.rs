//! Checked transfers over NIXL on loopback, both agents in this process (prefill on a thread):
//! push and pull land and are readable; a flipped byte, a decline and a notification that never
//! comes leave nothing readable and the pages scrubbed. Needs `libnixl_capi.so` (the `nixl-cu12`
//! wheel: `source scripts/ci/nixl.sh setup`); with `KVGUARD_REQUIRE_NIXL=1` its absence fails
//! the tests instead of skipping them.

/// Under `transfer::nixl::` so that `cargo test nixl` selects these.
mod transfer {
    mod nixl {
        use kvguard::transfer::nixl::{
            Direction, EnginePool, Extent, HostRegion, INBOX_BYTES, ImportError, KeepAlive, NixlAgent, NixlError,
            NixlLink, Notice, NoticeKind, PART_BYTES, PageRegion, RegionLayout, Segment, library_available,
        };
        use kvguard::transfer::{
            ExpectedTransfer, Manifest, Receiver, SenderId, TransferError, TransferHeader, page_checksum,
        };
        use kvguard::{OwnershipTable, PageId, PageRef, PoolConfig, RequestId, TenantId, ViolationKind};
        use std::borrow::Cow;
        use std::sync::{Arc, Mutex, mpsc};
        use std::time::{Duration, Instant};

        const PAGES: u32 = 8;
        const PAGE_SIZE: u32 = 4;
        const SLOT_BYTES: u32 = 16;
        const PAGE_BYTES: u32 = PAGE_SIZE * SLOT_BYTES;
        const REQ: RequestId = RequestId(1);
        /// Another tenant's request in decode's pool, with one written page.
        const VICTIM: RequestId = RequestId(2);
        const TENANT: TenantId = TenantId(5);
        const PROMPT: [u32; 6] = [11, 12, 13, 14, 15, 16];

        /// The pair's agents, or `None` (skipped) where the library is absent.
        fn agents(test: &str) -> Option<(NixlAgent, NixlAgent)> {
            if !library_available() {
                let required = std::env::var("KVGUARD_REQUIRE_NIXL").is_ok_and(|v| v == "1");
                assert!(!required, "KVGUARD_REQUIRE_NIXL=1 but libnixl_capi.so cannot be loaded");
                crate::common::skip::skipped(
                    "libnixl_capi.so not loadable (set up with `source scripts/ci/nixl.sh setup`)",
                );
                return None;
            }
            let decode = NixlAgent::new(&format!("decode-{test}")).expect("decode agent");
            let prefill = NixlAgent::new(&format!("prefill-{test}")).expect("prefill agent");
            Some((decode, prefill))
        }

        /// What prefill does with the pull it was sent.
        #[derive(Clone, Copy, PartialEq, Eq, Debug)]
        enum Prefill {
            Push,
            Stage,
            PushFlipped,
            Decline,
            Silent,
            /// Pushes the offered pages and one more, the victim's, naming it in the notice.
            PushExtra,
            /// Pushes in parts, one page a part, the first into the victim's page.
            PushStrayPart,
        }

        /// The KV of the prompt: each slot's bytes derived from its token.
        fn kv_pages() -> Vec<Vec<u8>> {
            PROMPT
                .chunks(PAGE_SIZE as usize)
                .map(|c| c.iter().flat_map(|&t| [t as u8; SLOT_BYTES as usize]).collect())
                .collect()
        }

        /// Both sides' host pages and decode's link to prefill; prefill connects back with
        /// `prefill_md` and `decode_layout` on its own thread.
        struct Pair<'a> {
            decode_region: HostRegion,
            prefill_region: HostRegion,
            decode_link: NixlLink<'a>,
            prefill_md: Vec<u8>,
            decode_layout: RegionLayout,
        }

        /// [`pair_of`] [`PAGES`] pages of [`PAGE_BYTES`].
        fn pair<'a>(decode: &'a NixlAgent, prefill: &NixlAgent) -> Pair<'a> {
            pair_of(decode, prefill, PAGES, PAGE_BYTES)
        }

        /// A [`Pair`] with `pages` pages of `page_bytes` each side.
        fn pair_of<'a>(decode: &'a NixlAgent, prefill: &NixlAgent, pages: u32, page_bytes: u32) -> Pair<'a> {
            let decode_region = HostRegion::new(decode, pages, page_bytes).unwrap();
            let prefill_region = HostRegion::new(prefill, pages, page_bytes).unwrap();
            let decode_link = NixlLink::connect(decode, &prefill.metadata().unwrap(), prefill_region.layout()).unwrap();
            let (prefill_md, decode_layout) = (decode.metadata().unwrap(), decode_region.layout());
            Pair { decode_region, prefill_region, decode_link, prefill_md, decode_layout }
        }

        /// Both sides' host pages and links, prefill's (`link`) connected on this thread.
        struct Linked<'a> {
            decode_region: HostRegion,
            prefill_region: HostRegion,
            decode_link: NixlLink<'a>,
            link: NixlLink<'a>,
        }

        /// [`Linked`] with `pages` pages of `page_bytes` each side.
        fn linked<'a>(decode: &'a NixlAgent, prefill: &'a NixlAgent, pages: u32, page_bytes: u32) -> Linked<'a> {
            let Pair { decode_region, prefill_region, decode_link, prefill_md, decode_layout } =
                pair_of(decode, prefill, pages, page_bytes);
            let link = NixlLink::connect(prefill, &prefill_md, decode_layout).unwrap();
            Linked { decode_region, prefill_region, decode_link, link }
        }

        /// Prefill's side of one attempt: the prompt's KV written into its pages `base..`, and the
        /// extents and manifest of a transfer of it into decode's `dest`.
        fn prefilled(region: &mut HostRegion, base: u32, dest: &[PageRef]) -> (Vec<Extent>, Vec<u8>) {
            let pages = kv_pages();
            let manifest = Manifest::build(header(SLOT_BYTES), &PROMPT, dest, &pages).unwrap().encode();
            let mut src = Vec::new();
            for (i, bytes) in pages.iter().enumerate() {
                let page = base + i as u32;
                region.bytes_mut(page, bytes.len() as u32).unwrap().copy_from_slice(bytes);
                src.push(Extent { page, len: bytes.len() as u32 });
            }
            (src, manifest)
        }

        /// Prefill's header of a transfer of [`REQ`]'s KV, slots of `slot_bytes`.
        fn header(slot_bytes: u32) -> TransferHeader {
            TransferHeader { request: REQ, tenant: TENANT, sender: SenderId(1), page_size: PAGE_SIZE, slot_bytes }
        }

        /// A decode table with [`REQ`] admitted for [`PROMPT`] and its two pages allocated.
        fn admitted() -> (OwnershipTable, Vec<PageRef>) {
            let table = OwnershipTable::new(PoolConfig::new(PAGES, PAGE_SIZE, 24)).unwrap();
            table.admit(REQ, TENANT, PROMPT.len() as u64, 2).unwrap();
            let refs = table.allocate(REQ, 2).unwrap();
            (table, refs)
        }

        /// The engine retries [`REQ`] in `table`: released, admitted again, two new pages (new
        /// incarnations).
        fn readmitted(table: &OwnershipTable) -> Vec<PageRef> {
            table.release(REQ).unwrap();
            table.admit(REQ, TENANT, PROMPT.len() as u64, 2).unwrap();
            table.allocate(REQ, 2).unwrap()
        }

        /// Prefill pushes [`prefilled`]'s KV from its pages `base..` into decode's `dest`,
        /// and waits up to 20 s for it to land.
        fn push_prefilled(link: &mut NixlLink<'_>, region: &mut HostRegion, base: u32, dest: &[PageRef]) {
            let (src, manifest) = prefilled(region, base, dest);
            let deadline = Instant::now() + Duration::from_secs(20);
            link.push(region, &src, &pages_of(dest), REQ, &manifest, deadline).unwrap();
        }

        /// What decode expects of [`admitted`]'s request landing in `refs`.
        fn expected_for(refs: &[PageRef]) -> ExpectedTransfer<'_> {
            ExpectedTransfer::for_prompt(REQ, TENANT, &PROMPT, refs, PAGE_SIZE, SLOT_BYTES)
        }

        /// A live peer: `link`'s agent moved along (no progress thread) until `until`, or `done()`.
        fn keep_serving(link: &mut NixlLink<'_>, until: Instant, done: impl Fn() -> bool) {
            while Instant::now() < until && !done() {
                let _ = link.wait(RequestId(777), &[NoticeKind::Released], Instant::now() + Duration::from_millis(20));
            }
        }

        /// What decode tells prefill's thread during [`stage_slow_pull`], and prefill tells it.
        struct SlowPullCues {
            /// Decode has the staged notice.
            seen: mpsc::Receiver<()>,
            /// Prefill's agent stands still from now on.
            still: mpsc::Sender<()>,
            /// Decode's short wait for the READ is over.
            go: mpsc::Receiver<()>,
            /// Decode is done (or gone: the sender dropped).
            done: mpsc::Receiver<()>,
        }

        /// Prefill's side of [`slow_pull`]'s READ, on a thread of the test's: stages its two pages
        /// with `manifest`, moves its agent until decode has the notice, then stands still until
        /// decode's 1 ms wait for the READ has ended: over TCP a READ is served by the agent it
        /// reads from, so it cannot complete in that wait, however the threads are scheduled (with
        /// prefill's agent moving all along, a loaded machine let the whole READ land first now
        /// and then). A live prefill then keeps its agent going until decode is done.
        fn stage_slow_pull(
            prefill: &NixlAgent,
            prefill_md: &[u8],
            decode_layout: RegionLayout,
            manifest: &[u8],
            cues: SlowPullCues,
        ) {
            let mut link = NixlLink::connect(prefill, prefill_md, decode_layout).unwrap();
            let extents: Vec<Extent> = (0..2).map(|page| Extent { page, len: SLOW_PAGE }).collect();
            let staged =
                Notice { kind: NoticeKind::Staged, request: REQ, extents, manifest: manifest.to_vec(), parts: 0 };
            link.send(&staged).unwrap();
            keep_serving(&mut link, Instant::now() + Duration::from_secs(10), || cues.seen.try_recv().is_ok());
            let _ = cues.still.send(());
            let _ = cues.go.recv_timeout(Duration::from_secs(30));
            let done = || !matches!(cues.done.try_recv(), Err(mpsc::TryRecvError::Empty));
            keep_serving(&mut link, Instant::now() + Duration::from_secs(30), done);
        }

        /// Runs `body` with `peer` live meanwhile: its agent moved along on a thread of its own
        /// until `body` returns or panics (60 s at most).
        fn with_live_peer<T>(peer: &mut NixlLink<'_>, body: impl FnOnce() -> T) -> T {
            let (done_tx, done_rx) = mpsc::channel::<()>();
            std::thread::scope(|s| {
                s.spawn(move || {
                    let until = Instant::now() + Duration::from_secs(60);
                    keep_serving(peer, until, || !matches!(done_rx.try_recv(), Err(mpsc::TryRecvError::Empty)));
                });
                let out = body();
                drop(done_tx);
                out
            })
        }

        /// `link.receive` into `region` with nothing to land (the bytes are written in place).
        fn received(
            link: &mut NixlLink<'_>,
            direction: Direction,
            pinned: kvguard::transfer::PinnedImport<'_>,
            expected: &ExpectedTransfer<'_>,
            region: &mut HostRegion,
            deadline: Instant,
        ) -> Result<kvguard::transfer::Accepted, ImportError> {
            link.receive(direction, pinned, expected, region, deadline, |_, _, _| Ok(()))
        }

        struct Outcome {
            verdict: Result<kvguard::transfer::Accepted, ImportError>,
            table: OwnershipTable,
            refs: Vec<PageRef>,
            landed: Vec<Vec<u8>>,
            victim: PageRef,
        }

        /// Decode pins and asks (a channel stands for the side channel); prefill answers as told.
        fn run(test: &str, direction: Direction, prefill_does: Prefill) -> Option<Outcome> {
            run_landing(test, direction, prefill_does, None)
        }

        /// [`run`], decode's `land` failing at entry `fail_landing_at` if given.
        fn run_landing(
            test: &str,
            direction: Direction,
            prefill_does: Prefill,
            fail_landing_at: Option<usize>,
        ) -> Option<Outcome> {
            let (decode, prefill) = agents(test)?;
            let Pair { mut decode_region, mut prefill_region, mut decode_link, prefill_md, decode_layout } =
                pair(&decode, &prefill);
            // Stale bytes of an earlier owner in decode's pages.
            for p in 0..PAGES {
                decode_region.bytes_mut(p, PAGE_BYTES).unwrap().fill(0xEE);
            }

            let (table, refs) = admitted();
            table.admit(VICTIM, TenantId(6), 4, 0).unwrap();
            let victim = table.allocate(VICTIM, 1).unwrap()[0];
            table.record_write_tokens(VICTIM, &[victim.page], 0..4).unwrap();
            let expected = expected_for(&refs);
            let (ask, asked) = mpsc::channel::<Vec<PageRef>>();
            let mut landed = Vec::new();
            let prefill_region = &mut prefill_region;
            let verdict = std::thread::scope(|s| {
                s.spawn(move || {
                    let mut link = NixlLink::connect(&prefill, &prefill_md, decode_layout).unwrap();
                    let prefill_region = prefill_region;
                    let dest = asked.recv().unwrap();
                    // Prefill's own pages, elsewhere in its pool.
                    let (mut src, manifest) = prefilled(prefill_region, 3, &dest);
                    if prefill_does == Prefill::PushFlipped {
                        prefill_region.bytes_mut(3, 8).unwrap()[5] ^= 1;
                    }
                    let mut dest_pages: Vec<PageId> = dest.iter().map(|r| r.page).collect();
                    let deadline = Instant::now() + Duration::from_secs(20);
                    match prefill_does {
                        Prefill::PushExtra | Prefill::PushStrayPart => {
                            let at = if prefill_does == Prefill::PushExtra { dest_pages.len() } else { 0 };
                            dest_pages.insert(at, victim.page);
                            src.insert(at, Extent { page: 6, len: PAGE_BYTES });
                            if prefill_does == Prefill::PushStrayPart {
                                link.set_parts(Some(1));
                            }
                            link.push(prefill_region, &src, &dest_pages, REQ, &manifest, deadline).unwrap()
                        }
                        Prefill::Push | Prefill::PushFlipped => {
                            link.push(prefill_region, &src, &dest_pages, REQ, &manifest, deadline).unwrap()
                        }
                        Prefill::Stage => link.stage(&src, REQ, &manifest, deadline).unwrap(),
                        Prefill::Decline => link.decline(REQ, deadline).unwrap(),
                        // The data, and no notification at all.
                        Prefill::Silent => {}
                    }
                });
                let pinned = Receiver::new(&table).pin(&expected).unwrap();
                ask.send(refs.clone()).unwrap();
                let wait = if prefill_does == Prefill::Silent { 300 } else { 20_000 };
                let deadline = Instant::now() + Duration::from_millis(wait);
                decode_link.receive(direction, pinned, &expected, &mut decode_region, deadline, |i, _, b| {
                    if fail_landing_at == Some(i) {
                        return Err("the engine's copy into its KV cache failed".into());
                    }
                    landed.push(b.to_vec());
                    Ok(())
                })
            });
            let landed_now =
                refs.iter().map(|r| decode_region.bytes(r.page.0, PAGE_BYTES).unwrap().to_vec()).collect::<Vec<_>>();
            let _ = landed_now.len();
            if verdict.is_err() {
                for bytes in &landed_now {
                    assert!(bytes.iter().all(|&b| b == 0), "{test}: a refused transfer's pages are scrubbed");
                }
            }
            Some(Outcome { verdict, table, refs, landed, victim })
        }

        fn pages_of(refs: &[PageRef]) -> Vec<PageId> {
            refs.iter().map(|r| r.page).collect()
        }

        #[test]
        fn a_push_lands_with_its_manifest_as_the_notification_and_reads_verify() {
            let Some(o) = run("push", Direction::Write, Prefill::Push) else { return };
            let accepted = o.verdict.expect("accepted");
            assert_eq!((accepted.tokens(), accepted.pages()), (6, 2));
            assert_eq!(o.landed, kv_pages());
            o.table.verify_read(REQ, &pages_of(&o.refs), 6).unwrap();
        }

        #[test]
        fn a_pull_reads_the_staged_pages_then_releases_them() {
            let Some(o) = run("pull", Direction::Read, Prefill::Stage) else { return };
            o.verdict.expect("accepted");
            assert_eq!(o.landed, kv_pages());
            o.table.verify_read(REQ, &pages_of(&o.refs), 6).unwrap();
        }

        #[test]
        fn a_flipped_byte_on_the_wire_is_refused_and_nothing_is_readable() {
            let Some(o) = run("flip", Direction::Write, Prefill::PushFlipped) else { return };
            let err = o.verdict.unwrap_err();
            assert!(matches!(err, ImportError::Refused(TransferError::PageChecksum { index: 0, .. })), "{err}");
            assert_eq!(o.table.counters().get(ViolationKind::PageChecksumMismatch), 1);
            assert!(o.landed.is_empty());
            assert!(o.table.verify_read(REQ, &pages_of(&o.refs), 1).is_err());
        }

        #[test]
        fn a_notification_that_never_comes_aborts_and_nothing_is_readable() {
            let Some(o) = run("silent", Direction::Write, Prefill::Silent) else { return };
            let err = o.verdict.unwrap_err();
            assert!(matches!(err, ImportError::Aborted(NixlError::Timeout { .. })), "{err}");
            // Not a verdict on content: no violation recorded; and the pages are unpinned.
            assert_eq!(o.table.counters().total(), 0);
            assert!(o.table.verify_read(REQ, &pages_of(&o.refs), 1).is_err());
            o.table.release(REQ).unwrap();
        }

        #[test]
        fn a_landing_that_fails_abandons_the_import_and_scrubs_its_pages() {
            for (test, direction, prefill, fail_at) in [
                ("land-push-0", Direction::Write, Prefill::Push, 0),
                ("land-push-1", Direction::Write, Prefill::Push, 1),
                ("land-pull-0", Direction::Read, Prefill::Stage, 0),
                ("land-pull-1", Direction::Read, Prefill::Stage, 1),
            ] {
                let Some(o) = run_landing(test, direction, prefill, Some(fail_at)) else { return };
                let err = o.verdict.unwrap_err();
                assert!(
                    matches!(err, ImportError::Refused(TransferError::Landing { index, .. }) if index == fail_at),
                    "{test}: {err}"
                );
                assert_eq!(o.landed.len(), fail_at, "{test}: landing stopped at the failing page");
                // Its own kind, once; the request is not quarantined for the receiver's failure.
                assert_eq!(o.table.counters().get(ViolationKind::LandingFailed), 1, "{test}");
                assert_eq!(o.table.counters().total(), 1, "{test}");
                assert!(!o.table.request_info(REQ).unwrap().quarantined, "{test}");
                // Nothing readable (the pages were scrubbed by `run`'s check), nothing pinned.
                let read = o.table.check_read(REQ, &pages_of(&o.refs), 1).unwrap_err();
                assert_eq!(read.kind(), ViolationKind::UnwrittenSlots, "{test}");
                o.table.begin_import(REQ, &o.refs).unwrap().abort();
            }
        }

        #[test]
        fn a_push_writing_beyond_the_offer_is_refused_and_the_page_it_overwrote_is_unreadable() {
            for (test, prefill) in [("extra", Prefill::PushExtra), ("stray-part", Prefill::PushStrayPart)] {
                let Some(o) = run(test, Direction::Write, prefill) else { return };
                let err = o.verdict.unwrap_err();
                assert!(matches!(err, ImportError::Refused(TransferError::Pages { .. })), "{test}: {err}");
                // The victim's page holds the attacker's bytes: its coverage is revoked, so its
                // owner's reads are refused until it writes the page again; the victim is not
                // quarantined, and the overwrite is recorded once, naming the page and its owner.
                let info = o.table.page_info(o.victim.page).unwrap();
                assert_eq!((info.owner, info.generation, info.written_slots), (Some(VICTIM), o.victim.generation, 0));
                let read = o.table.check_read(VICTIM, &[o.victim.page], 1).unwrap_err();
                assert_eq!(read.kind(), ViolationKind::UnwrittenSlots, "{test}");
                assert!(!o.table.request_info(VICTIM).unwrap().quarantined, "{test}");
                let overwrites: Vec<_> =
                    o.table.drain_violations().into_iter().filter(|v| v.page() == Some(o.victim.page)).collect();
                assert_eq!(overwrites.len(), 1, "{test}: {overwrites:?}");
                let v = &overwrites[0];
                assert_eq!(
                    (v.kind(), v.request(), v.owner()),
                    (ViolationKind::TransferPagesMismatch, Some(REQ), Some(VICTIM))
                );
                // Nothing of the refused transfer is readable either.
                assert!(o.table.check_read(REQ, &pages_of(&o.refs), 1).is_err(), "{test}");
            }
        }

        #[test]
        fn a_pull_retried_after_a_timeout_is_accepted_and_releases_only_its_own_staging() {
            // Decode's first pull times out; the request gets new pages and pulls again. Prefill's
            // late answer to the first pull must neither be taken for the retry's (stale_page)
            // nor end the retry's staging on prefill: decode answers it on its own.
            let Some((decode, prefill)) = agents("retry") else { return };
            let Pair { mut decode_region, mut prefill_region, mut decode_link, prefill_md, decode_layout } =
                pair(&decode, &prefill);
            let (table, first) = admitted();
            let (ask, asked) = mpsc::channel::<Vec<PageRef>>();
            let (go, late) = mpsc::channel::<()>();
            let prefill_region = &mut prefill_region;
            let (second, verdict) = std::thread::scope(|s| {
                s.spawn(move || {
                    let mut link = NixlLink::connect(&prefill, &prefill_md, decode_layout).unwrap();
                    // Each attempt staged in pages of its own: 3.. and 5.. of prefill's pool.
                    for (attempt, base) in [(0, 3u32), (1, 5u32)] {
                        let dest = asked.recv().unwrap();
                        if attempt == 0 {
                            late.recv().unwrap(); // after decode gave up on it
                        }
                        let (src, manifest) = prefilled(prefill_region, base, &dest);
                        link.stage(&src, REQ, &manifest, Instant::now() + Duration::from_secs(20)).unwrap();
                    }
                });
                let expected = expected_for(&first);
                let pinned = Receiver::new(&table).pin(&expected).unwrap();
                ask.send(first.clone()).unwrap();
                let deadline = Instant::now() + Duration::from_millis(200);
                let timed_out =
                    received(&mut decode_link, Direction::Read, pinned, &expected, &mut decode_region, deadline);
                assert!(matches!(timed_out, Err(ImportError::Aborted(NixlError::Timeout { .. }))));
                // The engine retries with new pages (new incarnations), and prefill answers late.
                let second = readmitted(&table);
                go.send(()).unwrap();
                let expected = expected_for(&second);
                let pinned = Receiver::new(&table).pin(&expected).unwrap();
                ask.send(second.clone()).unwrap();
                let deadline = Instant::now() + Duration::from_secs(20);
                let verdict =
                    received(&mut decode_link, Direction::Read, pinned, &expected, &mut decode_region, deadline);
                (second, verdict)
            });
            let accepted = verdict.expect("the retry is accepted");
            assert_eq!((accepted.tokens(), accepted.pages()), (6, 2));
            assert_eq!(table.counters().total(), 0, "nothing refused: the late answer was set aside");
            table.verify_read_refs(REQ, &second, 6).unwrap();
        }

        #[test]
        fn a_timed_out_push_keeps_its_pages_fenced_until_its_late_write_is_done() {
            // Decode gives up on a push; prefill WRITEs anyway, later. The pages must not reach
            // another request before that late WRITE is over: they stay pinned (out of the free
            // list once the request is released), and come back zeroed when its notice arrives.
            let Some((decode, prefill)) = agents("fence") else { return };
            let Pair { mut decode_region, mut prefill_region, mut decode_link, prefill_md, decode_layout } =
                pair(&decode, &prefill);
            let (table, refs) = admitted();
            let fenced: Vec<PageId> = pages_of(&refs);
            let expected = expected_for(&refs);
            let (go, late) = mpsc::channel::<()>();
            let prefill_region = &mut prefill_region;
            std::thread::scope(|s| {
                let dest = refs.clone();
                s.spawn(move || {
                    let mut link = NixlLink::connect(&prefill, &prefill_md, decode_layout).unwrap();
                    late.recv().unwrap();
                    push_prefilled(&mut link, prefill_region, 3, &dest);
                });
                let pinned = Receiver::new(&table).pin(&expected).unwrap();
                let deadline = Instant::now() + Duration::from_millis(200);
                let timed_out =
                    received(&mut decode_link, Direction::Write, pinned, &expected, &mut decode_region, deadline);
                assert!(matches!(timed_out, Err(ImportError::Aborted(NixlError::Timeout { .. }))));
                assert_eq!(decode_link.fenced(), 1);
                // The engine aborts the request: its pages leave it but are not handed out.
                table.release(REQ).unwrap();
                assert_eq!(table.snapshot().in_flight, 2);
                table.admit(RequestId(9), TenantId(9), 4 * (PAGES as u64 - 2), 0).unwrap();
                let others = table.allocate(RequestId(9), PAGES - 2).unwrap();
                assert!(others.iter().all(|r| !fenced.contains(&r.page)), "fenced pages were handed out");
                // Prefill's late WRITE lands; its notice lifts the fence, the pages zeroed first.
                go.send(()).unwrap();
                let until = Instant::now() + Duration::from_secs(20);
                let mut lifted = 0;
                while lifted == 0 && Instant::now() < until {
                    lifted = decode_link.settle_fences(&table, &mut decode_region).unwrap();
                    std::thread::sleep(Duration::from_millis(5));
                }
                assert_eq!((lifted, decode_link.fenced()), (1, 0));
            });
            assert_eq!(table.snapshot().in_flight, 0);
            for &page in &fenced {
                assert!(decode_region.bytes(page.0, PAGE_BYTES).unwrap().iter().all(|&b| b == 0), "zeroed");
            }
            // The pages go to the next request with nothing written.
            table.admit(RequestId(10), TenantId(10), 8, 0).unwrap();
            let next = table.claim(RequestId(10), &fenced).unwrap();
            assert!(next.iter().zip(&refs).all(|(n, old)| n.generation > old.generation));
            assert_eq!(table.check_read(RequestId(10), &fenced, 1).unwrap_err().kind(), ViolationKind::UnwrittenSlots);
        }

        #[test]
        fn notices_for_requests_nobody_asked_for_hold_at_most_inbox_bytes() {
            let Some((decode, prefill)) = agents("flood") else { return };
            let Linked { mut decode_link, link: mut prefill_link, .. } = linked(&decode, &prefill, PAGES, PAGE_BYTES);
            // 24 notices of 1 MiB each for requests decode never asked for: 24 MiB sent.
            for i in 0..24u64 {
                let notice = Notice {
                    kind: NoticeKind::Staged,
                    request: RequestId(1_000 + i),
                    extents: Vec::new(),
                    manifest: vec![0x5a; 1 << 20],
                    parts: 0,
                };
                prefill_link.send(&notice).unwrap();
            }
            let mut kept = 0;
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until {
                // Both agents move UCX along (no progress thread): prefill's sends leave, decode's
                // wait takes them into its inbox.
                let short = || Instant::now() + Duration::from_millis(20);
                assert!(prefill_link.wait(REQ, &[NoticeKind::Released], short()).is_err());
                let waited = decode_link.wait(REQ, &[NoticeKind::Released], short());
                assert!(matches!(waited, Err(NixlError::Timeout { .. })));
                kept = kept.max(decode_link.inbox_bytes());
                assert!(decode_link.inbox_bytes() <= INBOX_BYTES, "{} bytes kept", decode_link.inbox_bytes());
                if kept > INBOX_BYTES / 2 && decode_link.evicted() > 0 {
                    break;
                }
            }
            assert!(kept > INBOX_BYTES / 2, "the notices arrived and were kept up to the bound ({kept} bytes)");
            assert!(decode_link.evicted() > 0, "the oldest dropped to make room, and counted");
        }

        #[test]
        fn a_selective_link_drops_notices_for_requests_it_does_not_expect_on_arrival() {
            let Some((decode, prefill)) = agents("selective") else { return };
            let Linked { mut decode_link, link: mut prefill_link, .. } = linked(&decode, &prefill, PAGES, PAGE_BYTES);
            let (asked, later) = (RequestId(7), RequestId(8));
            decode_link.expect(asked);
            decode_link.expect(later);
            let big = |request| Notice {
                kind: NoticeKind::Staged,
                request,
                extents: Vec::new(),
                manifest: vec![0x5a; 1 << 20],
                parts: 0,
            };
            // 24 notices of 1 MiB for requests decode never asked for, then one for a request it
            // expects but is not waiting for yet, then the one it waits for.
            for i in 0..24u64 {
                prefill_link.send(&big(RequestId(1_000 + i))).unwrap();
            }
            prefill_link.send(&big(later)).unwrap();
            prefill_link.send(&Notice::bare(NoticeKind::Declined, asked)).unwrap();
            let until = Instant::now() + Duration::from_secs(10);
            let got = loop {
                let short = Instant::now() + Duration::from_millis(20);
                assert!(prefill_link.wait(REQ, &[NoticeKind::Released], short).is_err());
                match decode_link.wait(asked, &[NoticeKind::Declined], short) {
                    Ok(n) => break n,
                    Err(e) => assert!(Instant::now() < until, "the expected notice never came: {e}"),
                }
            };
            assert_eq!((got.kind, got.request), (NoticeKind::Declined, asked));
            // NIXL delivers a peer's notifications in order: every flood notice came before it.
            assert_eq!(decode_link.unasked(), 24, "each unasked notice dropped on arrival");
            let kept = decode_link.inbox_bytes();
            assert!((1 << 20..2 << 20).contains(&kept), "only the expected request's notice kept: {kept} bytes");
            // Forgotten: its notice goes, and later ones for it are dropped on arrival too.
            assert!(decode_link.forget(later));
            assert_eq!(decode_link.inbox_bytes(), 0);
            assert!(!decode_link.forget(later));
        }

        #[test]
        fn a_declined_pull_aborts() {
            let Some(o) = run("decline", Direction::Read, Prefill::Decline) else { return };
            assert!(matches!(o.verdict, Err(ImportError::Declined)));
            assert!(o.table.verify_read(REQ, &pages_of(&o.refs), 1).is_err());
        }

        /// The engine's own pool: memory it owns (here a `Vec`), described by its layout.
        struct Engine {
            memory: Vec<std::cell::UnsafeCell<u8>>,
        }

        impl Engine {
            fn new(pages: u32, page_bytes: u32) -> Engine {
                Engine { memory: (0..pages * page_bytes).map(|_| std::cell::UnsafeCell::new(0xEE)).collect() }
            }
            fn layout(&self, pages: u32, page_bytes: u32) -> RegionLayout {
                RegionLayout {
                    base: self.memory.as_ptr() as usize as u64,
                    page_bytes,
                    pages,
                    segment: Segment::Dram,
                    device: 0,
                }
            }
        }

        /// How prefill makes the manifest in [`push_into_engine_pool`].
        #[derive(Clone, Copy)]
        enum Build {
            /// `Manifest::build` over the pages, then `push`.
            Before,
            /// `push_prompt`: the manifest built while parts fly.
            OnTheWay,
            /// `push_prompt_ahead`: this many pages checksummed before the flip (while waiting
            /// for the offer, in an engine), the rest on the way.
            Ahead(usize),
        }

        /// A push of `pages` pages of `page_bytes` (several parts past [`PART_BYTES`]) into an
        /// engine's own pool on decode; `flip` flips a byte of that page on prefill's side (after
        /// the manifest was built, for `Build::Before`; after the pages ahead were checksummed, for
        /// `Build::Ahead`). A flip after its page's CRC was taken must be refused; none, accepted.
        fn push_into_engine_pool(
            test: &str,
            pages: u32,
            page_bytes: u32,
            flip: Option<u32>,
            build: Build,
        ) -> Option<()> {
            let (decode, prefill) = agents(test)?;
            let slot_bytes = page_bytes / PAGE_SIZE;
            let prompt: Vec<u32> = (0..pages * PAGE_SIZE).collect();
            let engine = Engine::new(pages + 2, page_bytes);
            // SAFETY: the engine's memory outlives the pool (dropped at the end of this function,
            // after `pool`), and nothing else reads or writes it meanwhile.
            let mut pool = unsafe { EnginePool::register(&decode, engine.layout(pages + 2, page_bytes)) }.unwrap();
            assert!(pool.owns_registration());
            let mut prefill_region = HostRegion::new(&prefill, pages, page_bytes).unwrap();
            let kv: Vec<Vec<u8>> =
                (0..pages).map(|p| (0..page_bytes).map(|i| (i.wrapping_mul(31) ^ p) as u8).collect()).collect();
            for (p, bytes) in kv.iter().enumerate() {
                prefill_region.bytes_mut(p as u32, page_bytes).unwrap().copy_from_slice(bytes);
            }
            let ahead: Vec<(usize, u32)> = match build {
                Build::Ahead(n) => kv[..n].iter().map(|b| (b.len(), page_checksum(b))).collect(),
                _ => Vec::new(),
            };
            if let Some(p) = flip {
                prefill_region.bytes_mut(p, page_bytes).unwrap()[page_bytes as usize - 1] ^= 0x10;
            }
            let mut decode_link =
                NixlLink::connect(&decode, &prefill.metadata().unwrap(), prefill_region.layout()).unwrap();
            let (prefill_md, pool_layout) = (decode.metadata().unwrap(), pool.layout());
            let table =
                OwnershipTable::new(PoolConfig::new(pages + 2, PAGE_SIZE, u64::from(pages * PAGE_SIZE))).unwrap();
            table.admit(REQ, TENANT, prompt.len() as u64, 0).unwrap();
            let refs = table.allocate(REQ, pages).unwrap();
            let expected = ExpectedTransfer::for_prompt(REQ, TENANT, &prompt, &refs, PAGE_SIZE, slot_bytes);
            let header = header(slot_bytes);
            let manifest = Manifest::build(header, &prompt, &refs, &kv).unwrap().encode();
            let verdict = std::thread::scope(|s| {
                let pinned = Receiver::new(&table).pin(&expected).unwrap();
                let (prefill_region, manifest, refs) = (&mut prefill_region, &manifest, &refs);
                s.spawn(move || {
                    let mut link = NixlLink::connect(&prefill, &prefill_md, pool_layout).unwrap();
                    link.set_parts(Some(PART_BYTES));
                    let src: Vec<Extent> = (0..pages).map(|page| Extent { page, len: page_bytes }).collect();
                    let dest: Vec<PageId> = refs.iter().map(|r| r.page).collect();
                    let deadline = Instant::now() + Duration::from_secs(20);
                    let (prompt, ahead) = (&prompt, &ahead);
                    match build {
                        Build::Before => link.push(&*prefill_region, &src, &dest, REQ, manifest, deadline).unwrap(),
                        Build::OnTheWay => {
                            link.push_prompt(&*prefill_region, &src, header, prompt, refs, deadline).unwrap()
                        }
                        Build::Ahead(_) => link
                            .push_prompt_ahead(&*prefill_region, &src, header, prompt, refs, ahead, deadline)
                            .unwrap(),
                    }
                });
                let deadline = Instant::now() + Duration::from_secs(20);
                decode_link.receive(Direction::Write, pinned, &expected, &mut pool, deadline, |_, _, _| Ok(()))
            });
            match flip {
                None => {
                    let accepted = verdict.expect("accepted");
                    assert_eq!(accepted.pages(), pages as usize);
                    for (r, bytes) in refs.iter().zip(&kv) {
                        assert_eq!(&*pool.page(r.page.0, page_bytes).unwrap(), &bytes[..], "{test}: landed in place");
                    }
                    table.verify_read(REQ, &pages_of(&refs), 1).unwrap();
                }
                Some(p) => {
                    let err = verdict.unwrap_err();
                    assert!(
                        matches!(err, ImportError::Refused(TransferError::PageChecksum { index, .. }) if index == p as usize),
                        "{test}: {err}"
                    );
                    for r in &refs {
                        assert!(pool.page(r.page.0, page_bytes).unwrap().iter().all(|&b| b == 0), "{test}: scrubbed");
                    }
                    assert!(table.verify_read(REQ, &pages_of(&refs), 1).is_err());
                }
            }
            drop(pool);
            drop(engine);
            Some(())
        }

        #[test]
        fn a_push_lands_in_place_in_an_engines_own_pool() {
            push_into_engine_pool("engine", 4, 1024, None, Build::Before);
        }

        #[test]
        fn a_push_in_parts_is_checksummed_as_it_lands_and_accepted() {
            let page_bytes = 2 << 20;
            assert!(u64::from(page_bytes) * 4 > PART_BYTES, "several parts");
            push_into_engine_pool("parts", 4, page_bytes, None, Build::Before);
        }

        #[test]
        fn a_push_that_builds_its_manifest_while_parts_fly_is_accepted() {
            push_into_engine_pool("prompt-parts", 4, 2 << 20, None, Build::OnTheWay);
            push_into_engine_pool("prompt-one", 2, 1024, None, Build::OnTheWay);
        }

        #[test]
        fn a_push_with_pages_checksummed_ahead_of_the_offer_is_accepted() {
            // Fewer, all, and more than the first part's pages ahead; one part and several.
            push_into_engine_pool("ahead-one", 4, 1024, None, Build::Ahead(2));
            push_into_engine_pool("ahead-all", 4, 1024, None, Build::Ahead(4));
            push_into_engine_pool("ahead-parts", 4, 2 << 20, None, Build::Ahead(2));
            push_into_engine_pool("ahead-none", 3, 1024, None, Build::Ahead(0));
        }

        #[test]
        fn a_page_changed_after_its_crc_was_taken_ahead_is_refused_and_the_pool_zeroed() {
            push_into_engine_pool("ahead-stale", 4, 1024, Some(1), Build::Ahead(2));
            push_into_engine_pool("ahead-stale-parts", 4, 2 << 20, Some(0), Build::Ahead(3));
        }

        #[test]
        fn a_push_whose_manifest_or_crcs_ahead_do_not_fit_sends_nothing() {
            let Some((decode, prefill)) = agents("prompt-bad") else { return };
            let region = HostRegion::new(&decode, 2, PAGE_BYTES).unwrap();
            let prefill_region = HostRegion::new(&prefill, 2, PAGE_BYTES).unwrap();
            let mut link = NixlLink::connect(&prefill, &decode.metadata().unwrap(), region.layout()).unwrap();
            let header = header(SLOT_BYTES);
            let dest = [PageRef { page: PageId(0), generation: kvguard::Generation(1) }];
            let src = [Extent { page: 0, len: PAGE_BYTES }];
            let deadline = Instant::now() + Duration::from_secs(5);
            // Six tokens need two pages: one extent, one receiving page.
            let err = link.push_prompt(&prefill_region, &src, header, &PROMPT, &dest, deadline).unwrap_err();
            assert!(matches!(err, NixlError::Extents { .. }), "{err}");
            // One page's prompt, with more CRCs ahead than pages, or one over another length.
            let prompt = &PROMPT[..PAGE_SIZE as usize];
            let sum = (PAGE_BYTES as usize, page_checksum(prefill_region.bytes(0, PAGE_BYTES).unwrap()));
            for ahead in [vec![sum, sum], vec![(PAGE_BYTES as usize - 1, sum.1)]] {
                let err =
                    link.push_prompt_ahead(&prefill_region, &src, header, prompt, &dest, &ahead, deadline).unwrap_err();
                assert!(matches!(err, NixlError::Extents { .. }), "{err}");
            }
            // Nothing was written: decode's page is as it was.
            assert!(region.bytes(0, PAGE_BYTES).unwrap().iter().all(|&b| b == 0));
        }

        #[test]
        fn a_flipped_byte_in_a_later_part_is_refused_and_the_pool_zeroed() {
            push_into_engine_pool("parts-flip", 4, 2 << 20, Some(3), Build::Before);
        }

        #[test]
        fn engine_pool_descriptions_that_do_not_fit_are_refused() {
            let Some((decode, _prefill)) = agents("pool-shape") else { return };
            let engine = Engine::new(2, 64);
            let good = engine.layout(2, 64);
            for bad in [
                RegionLayout { pages: 0, ..good },
                RegionLayout { page_bytes: 0, ..good },
                RegionLayout { base: 0, ..good },
                RegionLayout { base: u64::MAX - 64, ..good },
            ] {
                // SAFETY: refused before anything is registered, read or written.
                let err = unsafe { EnginePool::registered(bad) }.unwrap_err();
                assert!(matches!(err, NixlError::Extents { .. }), "{bad:?}: {err}");
            }
            // SAFETY: the engine's memory outlives the pool.
            let mut pool = unsafe { EnginePool::register(&decode, good) }.unwrap();
            assert!(matches!(pool.page(2, 1), Err(NixlError::Extents { .. })));
            assert!(matches!(pool.page(0, 65), Err(NixlError::Extents { .. })));
            assert!(matches!(pool.scrub(&[5]), Err(NixlError::Extents { .. })));
            pool.scrub(&[1]).unwrap();
            assert!(pool.page(1, 64).unwrap().iter().all(|&b| b == 0));
            assert!(pool.page(0, 64).unwrap().iter().all(|&b| b == 0xEE));
            // GPU memory: registered and named the same way, never read or written from the host.
            let vram = RegionLayout { segment: Segment::Vram, ..good };
            // SAFETY: never registered, read or written: only described.
            let mut gpu = unsafe { EnginePool::registered(vram) }.unwrap();
            assert!(matches!(gpu.page(0, 1), Err(NixlError::Segment { .. })));
            assert!(matches!(gpu.scrub(&[0]), Err(NixlError::Segment { .. })));
            drop(pool);
            drop(engine);
        }

        // ---- what may still land after a transfer decode gave up on -----------------------------

        /// Pages of 4 slots of 8 MiB (32 MiB): a READ of two outlives a 1 ms deadline.
        const SLOW_SLOT: u32 = 8 << 20;
        const SLOW_PAGE: u32 = PAGE_SIZE * SLOW_SLOT;

        /// A pull too large to READ in a 1 ms wait, with both sides' 4 pages of [`SLOW_PAGE`]
        /// ([`slow_pull`]): a decode table with [`REQ`] admitted for `prompt` (two pages) and its
        /// pages `refs` allocated, and the `manifest` of prefill's KV for them, in prefill's pages 0
        /// and 1 (all `OURS`).
        struct SlowPull {
            table: OwnershipTable,
            prompt: Vec<u32>,
            refs: Vec<PageRef>,
            manifest: Vec<u8>,
        }

        impl SlowPull {
            /// What decode expects of the pull.
            fn expected(&self) -> ExpectedTransfer<'_> {
                ExpectedTransfer::for_prompt(REQ, TENANT, &self.prompt, &self.refs, PAGE_SIZE, SLOW_SLOT)
            }
        }

        fn slow_pull<'a>(decode: &'a NixlAgent, prefill: &NixlAgent) -> (Pair<'a>, SlowPull) {
            let npages = 4u32;
            let mut pair = pair_of(decode, prefill, npages, SLOW_PAGE);
            let table = OwnershipTable::new(PoolConfig::new(npages, PAGE_SIZE, 8)).unwrap();
            let prompt: Vec<u32> = (0..2 * PAGE_SIZE).collect();
            table.admit(REQ, TENANT, prompt.len() as u64, 0).unwrap();
            let refs = table.allocate(REQ, 2).unwrap();
            let kv: Vec<Vec<u8>> = (0..2).map(|_| vec![OURS; SLOW_PAGE as usize]).collect();
            let manifest = Manifest::build(header(SLOW_SLOT), &prompt, &refs, &kv).unwrap().encode();
            for p in 0..2 {
                pair.prefill_region.bytes_mut(p, SLOW_PAGE).unwrap().fill(OURS);
            }
            (pair, SlowPull { table, prompt, refs, manifest })
        }

        /// A pull whose READ was posted and timed out: releasing a READ in flight may not stop
        /// it (NIXL tries to cancel, and may not), so its pages stay fenced with the READ's
        /// handle (no next owner can be handed them, released or not) until NIXL reports the
        /// READ complete; then they are zeroed and handed back. Before, they were unpinned at
        /// once, and a late READ of 32 MiB pages landed in another tenant's pages after it
        /// wrote them, which its reads then passed.
        #[test]
        fn a_pull_whose_read_timed_out_keeps_its_pages_fenced_until_the_read_completes() {
            let Some((decode, prefill)) = agents("read-fence") else { return };
            let (Pair { mut decode_region, prefill_region: _pr, mut decode_link, prefill_md, decode_layout }, slow) =
                slow_pull(&decode, &prefill);
            let (table, refs, manifest, expected) = (&slow.table, &slow.refs, &slow.manifest, slow.expected());
            let (done_tx, done_rx) = mpsc::channel::<()>();
            let (seen_tx, seen_rx) = mpsc::channel::<()>();
            let (still_tx, still_rx) = mpsc::channel::<()>();
            let (go_tx, go_rx) = mpsc::channel::<()>();
            std::thread::scope(|s| {
                s.spawn(move || {
                    let cues = SlowPullCues { seen: seen_rx, still: still_tx, go: go_rx, done: done_rx };
                    stage_slow_pull(&prefill, &prefill_md, decode_layout, manifest, cues);
                });
                let pinned = Receiver::new(table).pin(&expected).unwrap();
                let until = Instant::now() + Duration::from_secs(10);
                while decode_link.inbox_bytes() == 0 && Instant::now() < until {
                    decode_link.send(&Notice::bare(NoticeKind::Declined, RequestId(999))).unwrap();
                }
                assert!(decode_link.inbox_bytes() > 0, "prefill staged its pages");
                seen_tx.send(()).unwrap();
                still_rx.recv_timeout(Duration::from_secs(10)).unwrap();
                let deadline = Instant::now() + Duration::from_millis(1);
                let r =
                    decode_link
                        .receive(Direction::Read, pinned, &expected, &mut decode_region, deadline, |_, _, _| Ok(()));
                let _ = go_tx.send(());
                assert!(matches!(r, Err(ImportError::Aborted(NixlError::Timeout { .. }))), "{r:?}");
                assert_eq!(decode_link.fenced(), 1, "the READ still in flight fences its pages");
                // The request ends; its pages are not handed to the next one while fenced.
                table.release(REQ).unwrap();
                let pages: Vec<PageId> = refs.iter().map(|r| r.page).collect();
                table.admit(RequestId(20), TenantId(20), 8, 0).unwrap();
                assert!(table.claim(RequestId(20), &pages).is_err(), "a fenced page handed on");
                // Once NIXL reports the READ complete, the fence is lifted and the pages zeroed.
                let until = Instant::now() + Duration::from_secs(20);
                while decode_link.fenced() > 0 && Instant::now() < until {
                    decode_link.settle_fences(table, &mut decode_region).unwrap();
                }
                let _ = done_tx.send(());
                assert_eq!(decode_link.fenced(), 0, "the READ completed and its fence was lifted");
                for p in &pages {
                    assert!(decode_region.bytes(p.0, SLOW_PAGE).unwrap().iter().all(|&b| b == 0), "zeroed");
                }
                table.claim(RequestId(20), &pages).unwrap();
            });
        }

        /// A push whose `Part` named a page outside the offer, then timed out: refused (the
        /// page named is treated as overwritten), and the offered pages stay fenced, since the
        /// rest of the push may still WRITE them. Before, they were unpinned.
        #[test]
        fn a_push_with_a_stray_part_that_times_out_is_refused_and_fenced() {
            let Some((decode, prefill)) = agents("stray-fence") else { return };
            let Pair { mut decode_region, prefill_region: _pr, mut decode_link, prefill_md, decode_layout } =
                pair(&decode, &prefill);
            let (table, refs) = admitted();
            let expected = expected_for(&refs);
            std::thread::scope(|s| {
                s.spawn(move || {
                    let mut link = NixlLink::connect(&prefill, &prefill_md, decode_layout).unwrap();
                    // A part naming page 7 (not offered); the rest of the push never comes.
                    let stray = Extent { page: 7, len: PAGE_BYTES };
                    link.send(&Notice { extents: vec![stray], ..Notice::bare(NoticeKind::Part, REQ) }).unwrap();
                    keep_serving(&mut link, Instant::now() + Duration::from_millis(600), || false);
                });
                let pinned = Receiver::new(&table).pin(&expected).unwrap();
                let deadline = Instant::now() + Duration::from_millis(300);
                let r = received(&mut decode_link, Direction::Write, pinned, &expected, &mut decode_region, deadline);
                assert!(matches!(r, Err(ImportError::Refused(TransferError::Pages { .. }))), "{r:?}");
                assert_eq!(decode_link.fenced(), 1, "a push that did not finish stays fenced");
                table.release(REQ).unwrap();
                assert_eq!(table.snapshot().in_flight, 2, "its pages pinned past the request's end");
            });
        }

        /// A retry after a push in parts timed out (its pages fenced): the first attempt's late
        /// `Part` notices name only fenced pages and are not counted as the retry's; the retry
        /// is accepted, its request not charged. Before, they were counted: the retry was
        /// refused (`transfer_pages_mismatch`) and its request quarantined.
        #[test]
        fn a_retry_after_a_fenced_push_in_parts_is_not_charged_with_its_late_parts() {
            let Some((decode, prefill)) = agents("retry-parts") else { return };
            let Pair { mut decode_region, mut prefill_region, mut decode_link, prefill_md, decode_layout } =
                pair(&decode, &prefill);
            let (table, first) = admitted();
            let (ask, asked) = mpsc::channel::<Vec<PageRef>>();
            let prefill_region = &mut prefill_region;
            let verdict = std::thread::scope(|s| {
                s.spawn(move || {
                    let mut link = NixlLink::connect(&prefill, &prefill_md, decode_layout).unwrap();
                    link.set_parts(Some(1)); // one page a part
                    let d1 = asked.recv().unwrap();
                    let d2 = asked.recv().unwrap(); // the retry's offer: attempt 1 comes late
                    std::thread::sleep(Duration::from_millis(100));
                    for (base, dest) in [(3u32, &d1), (5u32, &d2)] {
                        push_prefilled(&mut link, prefill_region, base, dest);
                    }
                });
                decode_link.expect(REQ);
                let expected = expected_for(&first);
                let pinned = Receiver::new(&table).pin(&expected).unwrap();
                ask.send(first.clone()).unwrap();
                let deadline = Instant::now() + Duration::from_millis(50);
                let r = received(&mut decode_link, Direction::Write, pinned, &expected, &mut decode_region, deadline);
                assert!(matches!(r, Err(ImportError::Aborted(NixlError::Timeout { .. }))), "{r:?}");
                assert_eq!(decode_link.fenced(), 1);
                let second = readmitted(&table);
                decode_link.expect(REQ);
                let expected = expected_for(&second);
                let pinned = Receiver::new(&table).pin(&expected).unwrap();
                ask.send(second.clone()).unwrap();
                let deadline = Instant::now() + Duration::from_secs(20);
                received(&mut decode_link, Direction::Write, pinned, &expected, &mut decode_region, deadline)
            });
            let violations: Vec<_> = table.drain_violations().iter().map(|v| v.kind()).collect();
            assert!(verdict.is_ok(), "the retry refused: {:?}; violations {violations:?}", verdict.err());
            assert!(violations.is_empty(), "{violations:?}");
            assert!(!table.request_info(REQ).unwrap().quarantined);
        }

        /// A push never truncates silently: more source pages than destinations is an error.
        #[test]
        fn a_push_of_more_pages_than_destinations_is_an_error() {
            let Some((decode, prefill)) = agents("push-extents") else { return };
            let Linked { decode_region: _dr, prefill_region, decode_link: _dl, mut link } =
                linked(&decode, &prefill, PAGES, PAGE_BYTES);
            let src: Vec<Extent> = (0..2).map(|page| Extent { page, len: PAGE_BYTES }).collect();
            let r = link.push(&prefill_region, &src, &[PageId(0)], REQ, &[], Instant::now() + Duration::from_secs(5));
            assert!(matches!(r, Err(NixlError::Extents { .. })), "{r:?}");
        }

        /// Decode gives up on an offered push without a receive (its request ended): the push
        /// may still WRITE the pages offered, so `abandon` fences them (never handed on while it
        /// may land) until its late `Written` comes; then they are zeroed and handed back.
        #[test]
        fn an_offered_push_given_up_on_keeps_its_pages_fenced_until_it_lands() {
            let Some((decode, prefill)) = agents("abandon-push") else { return };
            let Pair { mut decode_region, mut prefill_region, mut decode_link, prefill_md, decode_layout } =
                pair(&decode, &prefill);
            let (table, refs) = admitted();
            let (go, gone) = mpsc::channel::<()>();
            let prefill_region = &mut prefill_region;
            let dest = refs.clone();
            std::thread::scope(|s| {
                s.spawn(move || {
                    let mut link = NixlLink::connect(&prefill, &prefill_md, decode_layout).unwrap();
                    gone.recv().unwrap(); // pushes only after decode gave up
                    push_prefilled(&mut link, prefill_region, 3, &dest);
                });
                decode_link.expect(REQ);
                let expected = expected_for(&refs);
                let pinned = Receiver::new(&table).pin(&expected).unwrap();
                decode_link.abandon(Direction::Write, pinned);
                assert_eq!(decode_link.fenced(), 1);
                table.release(REQ).unwrap();
                assert_eq!(table.snapshot().in_flight, 2, "its pages pinned past the request's end");
                go.send(()).unwrap();
                let until = Instant::now() + Duration::from_secs(20);
                while decode_link.fenced() > 0 && Instant::now() < until {
                    decode_link.settle_fences(&table, &mut decode_region).unwrap();
                }
                assert_eq!(decode_link.fenced(), 0, "the late push landed and its fence was lifted");
                assert_eq!(table.snapshot().in_flight, 0);
                for r in &refs {
                    assert!(decode_region.bytes(r.page.0, PAGE_BYTES).unwrap().iter().all(|&b| b == 0), "zeroed");
                }
            });
            assert!(table.drain_violations().is_empty());
        }

        // ---- what a transfer decode gave up on may still land in: decode's region ------------

        /// Decode's pages behind an `Arc` it shares with the link as their keep-alive, so that a
        /// test sees when the last share goes (`Weak::strong_count`); locked, so that a fence's
        /// scrub reaches them through any handle.
        struct SharedLanding(Arc<Mutex<HostRegion>>);

        impl PageRegion for SharedLanding {
            fn layout(&self) -> RegionLayout {
                self.0.lock().unwrap().layout()
            }
            fn page(&self, page: u32, len: u32) -> Result<Cow<'_, [u8]>, NixlError> {
                self.0.lock().unwrap().bytes(page, len).map(|b| Cow::Owned(b.to_vec()))
            }
            fn scrub(&mut self, pages: &[u32]) -> Result<(), NixlError> {
                self.0.lock().unwrap().scrub(pages.iter().copied())
            }
            fn keep_alive(&self) -> Option<KeepAlive> {
                Some(KeepAlive::new(self.0.clone()))
            }
        }

        /// `link.receive` into a [`SharedLanding`] of `landing`, nothing to land.
        fn received_in(
            link: &mut NixlLink<'_>,
            direction: Direction,
            pinned: kvguard::transfer::PinnedImport<'_>,
            expected: &ExpectedTransfer<'_>,
            landing: &Arc<Mutex<HostRegion>>,
            deadline: Instant,
        ) -> Result<kvguard::transfer::Accepted, ImportError> {
            link.receive(direction, pinned, expected, &mut SharedLanding(landing.clone()), deadline, |_, _, _| Ok(()))
        }

        /// Settles `link`'s fences through the region it keeps alive (the engine dropped its
        /// own handles: the test reaches the region through `alive`) until none is left (20 s at
        /// most); every region handle it took is dropped on return.
        fn settle_kept(link: &mut NixlLink<'_>, table: &OwnershipTable, alive: &std::sync::Weak<Mutex<HostRegion>>) {
            let until = Instant::now() + Duration::from_secs(20);
            while link.fenced() > 0 && Instant::now() < until {
                let kept = alive.upgrade().expect("the region of a standing fence was freed");
                link.settle_fences(table, &mut SharedLanding(kept)).unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
        }

        /// Decode gives up on a push (its wait timed out) and the engine drops its region (its
        /// last handle) while the push may still WRITE the offered pages: the fence keeps the
        /// region registered and allocated, the late WRITE lands in it, and it is freed once
        /// `settle_fences` lifted the fence (its `Written` came: nothing more lands). Before, the
        /// fence kept the pages pinned but not the region: freed at the drop, the late WRITE
        /// landed in memory that was gone.
        #[test]
        fn a_region_a_fenced_push_may_land_in_outlives_its_owners_drop_until_its_late_write_is_done() {
            let Some((decode, prefill)) = agents("fence-keep-alive") else { return };
            let Pair { decode_region, mut prefill_region, mut decode_link, prefill_md, decode_layout } =
                pair(&decode, &prefill);
            let (table, refs) = admitted();
            let expected = expected_for(&refs);
            let landing = Arc::new(Mutex::new(decode_region));
            let alive = Arc::downgrade(&landing);
            let prefill_region = &mut prefill_region;
            std::thread::scope(|s| {
                // Dropped if the test fails: prefill's thread ends rather than wait.
                let (go, late) = mpsc::channel::<()>();
                let dest = refs.clone();
                s.spawn(move || {
                    let mut link = NixlLink::connect(&prefill, &prefill_md, decode_layout).unwrap();
                    late.recv().unwrap();
                    push_prefilled(&mut link, prefill_region, 3, &dest);
                });
                let pinned = Receiver::new(&table).pin(&expected).unwrap();
                let deadline = Instant::now() + Duration::from_millis(200);
                let timed_out = received_in(&mut decode_link, Direction::Write, pinned, &expected, &landing, deadline);
                assert!(matches!(timed_out, Err(ImportError::Aborted(NixlError::Timeout { .. }))), "{timed_out:?}");
                assert_eq!(decode_link.fenced(), 1);
                table.release(REQ).unwrap();
                drop(landing);
                assert_eq!(alive.strong_count(), 1, "the fence keeps the region its late WRITE lands in");
                // Prefill's late WRITE lands in the kept region; its notice lifts the fence.
                go.send(()).unwrap();
                settle_kept(&mut decode_link, &table, &alive);
            });
            assert_eq!(decode_link.fenced(), 0, "the late push landed and its fence was lifted");
            assert_eq!(table.snapshot().in_flight, 0);
            assert_eq!(alive.strong_count(), 0, "freed once the fence was lifted");
        }

        /// A READ that outlived decode's wait lands in the region `receive` was given: its fence
        /// keeps that region alive after the engine dropped it, until NIXL reports the READ
        /// complete and `settle_fences` lifts the fence; then it is freed.
        #[test]
        fn a_region_a_fenced_read_lands_in_outlives_its_owners_drop_until_the_read_completes() {
            let Some((decode, prefill)) = agents("read-fence-keep-alive") else { return };
            let (Pair { decode_region, prefill_region: _pr, mut decode_link, prefill_md, decode_layout }, slow) =
                slow_pull(&decode, &prefill);
            let (table, manifest, expected) = (&slow.table, &slow.manifest, slow.expected());
            let landing = Arc::new(Mutex::new(decode_region));
            let alive = Arc::downgrade(&landing);
            std::thread::scope(|s| {
                // Dropped if the test fails: prefill's thread ends rather than wait.
                let (done_tx, done_rx) = mpsc::channel::<()>();
                let (seen_tx, seen_rx) = mpsc::channel::<()>();
                let (still_tx, still_rx) = mpsc::channel::<()>();
                let (go_tx, go_rx) = mpsc::channel::<()>();
                s.spawn(move || {
                    let cues = SlowPullCues { seen: seen_rx, still: still_tx, go: go_rx, done: done_rx };
                    stage_slow_pull(&prefill, &prefill_md, decode_layout, manifest, cues);
                });
                let pinned = Receiver::new(table).pin(&expected).unwrap();
                let until = Instant::now() + Duration::from_secs(10);
                while decode_link.inbox_bytes() == 0 && Instant::now() < until {
                    decode_link.send(&Notice::bare(NoticeKind::Declined, RequestId(999))).unwrap();
                }
                assert!(decode_link.inbox_bytes() > 0, "prefill staged its pages");
                seen_tx.send(()).unwrap();
                still_rx.recv_timeout(Duration::from_secs(10)).unwrap();
                let deadline = Instant::now() + Duration::from_millis(1);
                let r = received_in(&mut decode_link, Direction::Read, pinned, &expected, &landing, deadline);
                assert!(matches!(r, Err(ImportError::Aborted(NixlError::Timeout { .. }))), "{r:?}");
                assert_eq!(decode_link.fenced(), 1, "the READ still in flight fences its pages");
                drop(landing);
                assert_eq!(alive.strong_count(), 1, "the fence keeps the region its READ lands in");
                go_tx.send(()).unwrap();
                settle_kept(&mut decode_link, table, &alive);
                let _ = done_tx.send(());
            });
            assert_eq!(decode_link.fenced(), 0, "the READ completed and its fence was lifted");
            assert_eq!(alive.strong_count(), 0, "freed once the fence was lifted");
        }

        /// Fences lifted with no proof that nothing more lands (`release_fences`: the engine says
        /// the peer is gone, but a READ queued in this agent may still run), and the fences of a
        /// link dropped while they stand, never free the regions they kept: leaked. `abandon`
        /// takes no region: its fence keeps none.
        #[test]
        fn a_region_a_released_or_dropped_fence_kept_is_never_freed() {
            let Some((decode, prefill)) = agents("fence-leak") else { return };
            let Pair { decode_region, prefill_region: _pr, mut decode_link, .. } = pair(&decode, &prefill);
            let (table, refs) = admitted();
            let expected = expected_for(&refs);
            let landing = Arc::new(Mutex::new(decode_region));
            let alive = Arc::downgrade(&landing);
            // Prefill never pushes: decode's wait times out and the offered pages are fenced.
            let pinned = Receiver::new(&table).pin(&expected).unwrap();
            let deadline = Instant::now() + Duration::from_millis(20);
            let timed_out = received_in(&mut decode_link, Direction::Write, pinned, &expected, &landing, deadline);
            assert!(matches!(timed_out, Err(ImportError::Aborted(NixlError::Timeout { .. }))), "{timed_out:?}");
            drop(landing);
            assert_eq!((decode_link.fenced(), alive.strong_count()), (1, 1));
            let kept = alive.upgrade().unwrap();
            assert_eq!(decode_link.release_fences(&table, &mut SharedLanding(kept)), 1);
            assert_eq!(decode_link.fenced(), 0);
            assert_eq!(alive.strong_count(), 1, "released, not proven over: leaked, never freed");
            // A retry times out too (its pages fenced), and one more is abandoned (fenced, no
            // region kept); then the link is dropped with both fences standing.
            let again = readmitted(&table);
            let expected = expected_for(&again);
            let landing = Arc::new(Mutex::new(HostRegion::new(&decode, PAGES, PAGE_BYTES).unwrap()));
            let alive = Arc::downgrade(&landing);
            let pinned = Receiver::new(&table).pin(&expected).unwrap();
            let deadline = Instant::now() + Duration::from_millis(20);
            let timed_out = received_in(&mut decode_link, Direction::Write, pinned, &expected, &landing, deadline);
            assert!(matches!(timed_out, Err(ImportError::Aborted(NixlError::Timeout { .. }))), "{timed_out:?}");
            let third = readmitted(&table);
            let pinned = Receiver::new(&table).pin(&expected_for(&third)).unwrap();
            decode_link.abandon(Direction::Write, pinned);
            assert_eq!(decode_link.fenced(), 2);
            assert_eq!(alive.strong_count(), 2, "the abandoned push's fence keeps no region");
            drop(landing);
            drop(decode_link);
            assert_eq!(alive.strong_count(), 1, "a link dropped while fencing leaks the region, never frees it");
        }

        // ---- what a push that failed may still read: prefill's source pages --------------------

        /// Pages of 8 MiB: a push of a few, a part each, outlives a deadline already passed.
        const BIG_PAGE: u32 = 8 << 20;
        const OURS: u8 = 0xA5;
        const NEXT_TENANTS: u8 = 0xBB;

        /// [`linked`] with `pages` pages of [`BIG_PAGE`] each side, prefill's filled with `OURS`.
        fn big_linked<'a>(decode: &'a NixlAgent, prefill: &'a NixlAgent, pages: u32) -> Linked<'a> {
            let mut linked = linked(decode, prefill, pages, BIG_PAGE);
            for p in 0..pages {
                linked.prefill_region.bytes_mut(p, BIG_PAGE).unwrap().fill(OURS);
            }
            linked
        }

        /// A push of [`REQ`] from `region`'s pages `src` into decode's `dest` whose deadline has
        /// already passed: it fails at once, with every part (a page each) in flight, since
        /// decode's agent is not called yet and 32 MiB cannot all leave by the push's first poll.
        fn push_at_once<R: PageRegion + ?Sized>(
            link: &mut NixlLink<'_>,
            region: &R,
            src: &[u32],
            dest: &[u32],
        ) -> NixlError {
            let src: Vec<Extent> = src.iter().map(|&page| Extent { page, len: BIG_PAGE }).collect();
            let dest: Vec<PageId> = dest.iter().copied().map(PageId).collect();
            let err = link.push(region, &src, &dest, REQ, &[], Instant::now()).unwrap_err();
            assert!(matches!(err.cause(), NixlError::Timeout { .. }), "{err}");
            err
        }

        /// Asserts that each of decode's pages `pages` holds what prefill pushed (`OURS`) whole.
        fn landed_whole(decode_region: &HostRegion, pages: std::ops::Range<u32>) {
            for p in pages {
                assert!(decode_region.bytes(p, BIG_PAGE).unwrap().iter().all(|&b| b == OURS), "decode's page {p}");
            }
        }

        /// A push whose deadline passes with its WRITEs in flight. Releasing a WRITE does not
        /// stop it (on loopback TCP it goes on, and reads the source pages as they are *then*),
        /// so the push reports the source pages its unfinished WRITEs may still read
        /// (`NixlError::InFlight`) and the link keeps those WRITEs until NIXL reports them
        /// complete (`settle_pushes`). An engine that writes the next tenant's KV into each
        /// source page as soon as the library lets it go never sends that KV to decode. Before,
        /// the WRITEs were released at the error and every page looked free: the late WRITEs
        /// carried the next tenant's KV into decode's pages.
        #[test]
        fn a_push_that_fails_with_writes_in_flight_holds_its_source_pages_until_they_complete() {
            let Some((decode, prefill)) = agents("push-in-flight") else { return };
            let npages = 4u32;
            let Linked { decode_region, mut prefill_region, mut decode_link, mut link } =
                big_linked(&decode, &prefill, npages);
            let err = push_at_once(&mut link, &prefill_region, &[0, 1, 2, 3], &[0, 1, 2, 3]);
            // A live decode from now on: its agent moves along, so the WRITEs can complete.
            let handed = with_live_peer(&mut decode_link, || {
                // The engine reuses each source page as soon as the library lets it go.
                let free: Vec<u32> = (0..npages).filter(|p| !err.in_flight().contains(p)).collect();
                for &p in &free {
                    prefill_region.bytes_mut(p, BIG_PAGE).unwrap().fill(NEXT_TENANTS);
                }
                let handed = settle_reusing(&mut link, &mut prefill_region);
                // Whatever of the push might still come lands meanwhile.
                keep_serving(&mut link, Instant::now() + Duration::from_millis(500), || false);
                handed
            });
            for p in 0..npages {
                assert!(
                    !decode_region.bytes(p, BIG_PAGE).unwrap().contains(&NEXT_TENANTS),
                    "decode's page {p} holds the next tenant's KV: a source page was let go while a WRITE read it"
                );
            }
            let held = err.in_flight().to_vec();
            assert!(!held.is_empty(), "the push was posted and timed out with WRITEs in flight: {err}");
            assert_eq!(link.in_flight(), vec![], "every WRITE completed");
            assert_eq!(
                sorted(handed),
                sorted(held),
                "the pages held are handed back, each once, when their WRITE completed"
            );
            // The WRITEs completed whole, with the KV the pages held when pushed.
            landed_whole(&decode_region, 0..npages);
        }

        /// Settles `link`'s pushes until nothing is held (or 30 s), the engine reusing each page
        /// handed back at once (`NEXT_TENANTS`); asserts that a page handed back is named by no
        /// held transfer any more and comes back once. Returns the pages handed back.
        fn settle_reusing(link: &mut NixlLink<'_>, region: &mut HostRegion) -> Vec<u32> {
            let mut handed: Vec<u32> = Vec::new();
            let until = Instant::now() + Duration::from_secs(30);
            while !link.in_flight().is_empty() && Instant::now() < until {
                for (request, pages) in link.settle_pushes() {
                    assert_eq!(request, REQ);
                    let still = link.in_flight();
                    for &p in &pages {
                        assert!(
                            !still.iter().any(|(_, held)| held.contains(&p)),
                            "page {p} handed back while a held WRITE still reads it: {still:?}"
                        );
                        assert!(!handed.contains(&p), "page {p} handed back twice");
                        region.bytes_mut(p, BIG_PAGE).unwrap().fill(NEXT_TENANTS);
                        handed.push(p);
                    }
                }
                std::thread::yield_now();
            }
            handed
        }

        fn sorted(mut pages: Vec<u32>) -> Vec<u32> {
            pages.sort_unstable();
            pages
        }

        /// The engine retries a push that failed with its WRITEs in flight from the same source
        /// pages: the retry is refused before anything is sent (`Extents`), and so is staging
        /// those pages, so a page has one holder, comes back once, and only when the WRITE that
        /// reads it is done; a retry from other pages lands while the first push is held, and its
        /// `Ok` frees nothing of it; once settled, a retry from the pages lands. Before, the
        /// retry was posted too and failed: `in_flight` listed each page twice, `settle_pushes`
        /// handed the pages back when the first push's WRITEs completed (the retry's still
        /// reading them: the next tenant's KV to decode) and again when the retry's did.
        #[test]
        fn a_retried_push_of_pages_still_held_is_refused_and_each_page_comes_back_once() {
            let Some((decode, prefill)) = agents("push-retry-held") else { return };
            let Linked { decode_region, mut prefill_region, mut decode_link, mut link } =
                big_linked(&decode, &prefill, 8);
            let err = push_at_once(&mut link, &prefill_region, &[0, 1, 2, 3], &[0, 1, 2, 3]);
            let held = err.in_flight().to_vec();
            assert!(!held.is_empty(), "{err}");
            let src: Vec<Extent> = (0..4).map(|page| Extent { page, len: BIG_PAGE }).collect();
            let dest: Vec<PageId> = (4..8).map(PageId).collect();
            let retry = link.push(&prefill_region, &src, &dest, REQ, &[], Instant::now()).unwrap_err();
            assert!(matches!(retry, NixlError::Extents { .. }), "{retry}");
            assert_eq!(retry.in_flight(), &[] as &[u32]);
            let staged = link.stage(&src[..1], RequestId(9), &[], Instant::now()).unwrap_err();
            assert!(matches!(staged, NixlError::Extents { .. }), "{staged}");
            assert_eq!(link.in_flight(), vec![(REQ, held.clone())], "each held page listed once");
            assert_eq!(link.held_pages(), held.len());
            let handed = with_live_peer(&mut decode_link, || {
                // A retry from copies of the KV (pages 4-7) lands while the first push is held.
                let copies: Vec<Extent> = (4..8).map(|page| Extent { page, len: BIG_PAGE }).collect();
                let deadline = Instant::now() + Duration::from_secs(20);
                link.push(&prefill_region, &copies, &dest, REQ, &[], deadline).unwrap();
                assert_eq!(link.in_flight(), vec![(REQ, held.clone())], "the retry's Ok frees nothing held");
                let handed = settle_reusing(&mut link, &mut prefill_region);
                // Settled: the pages may be pushed again.
                for p in 0..4 {
                    prefill_region.bytes_mut(p, BIG_PAGE).unwrap().fill(OURS);
                }
                let deadline = Instant::now() + Duration::from_secs(20);
                link.push(&prefill_region, &src, &dest, REQ, &[], deadline).unwrap();
                handed
            });
            assert_eq!(sorted(handed), sorted(held), "every held page handed back once");
            assert_eq!((link.in_flight(), link.held_pages()), (vec![], 0));
            landed_whole(&decode_region, 0..8);
        }

        /// A push naming one source page twice (into two of decode's pages): two held WRITEs read
        /// it, so it comes back once, when both completed, and the error and `in_flight` name it
        /// once. Before, `NixlError::in_flight` and `in_flight` named it twice and `settle_pushes`
        /// handed it back twice, the first time while the other WRITE still read it.
        #[test]
        fn a_source_page_two_held_writes_read_comes_back_once_when_both_completed() {
            let Some((decode, prefill)) = agents("push-page-twice") else { return };
            let Linked { decode_region, mut prefill_region, mut decode_link, mut link } =
                big_linked(&decode, &prefill, 8);
            let err = push_at_once(&mut link, &prefill_region, &[0, 1, 0, 1], &[0, 1, 2, 3]);
            let held = err.in_flight().to_vec();
            assert_eq!(sorted(held.clone()), vec![0, 1], "each page named once: {err}");
            assert_eq!(link.in_flight(), vec![(REQ, held.clone())]);
            assert_eq!(link.held_pages(), 2);
            let handed = with_live_peer(&mut decode_link, || {
                let handed = settle_reusing(&mut link, &mut prefill_region);
                keep_serving(&mut link, Instant::now() + Duration::from_millis(500), || false);
                handed
            });
            assert_eq!(sorted(handed), vec![0, 1]);
            assert_eq!(link.settle_pushes(), vec![]);
            assert_eq!(link.release_pushes(), vec![], "nothing left to hand back");
            landed_whole(&decode_region, 0..4);
        }

        /// `release_pushes` (the engine knows the peer gone) hands each held page back once,
        /// however many held WRITEs read it. Before, it handed the page twice back: an allocator
        /// freeing it twice gives it to two requests.
        #[test]
        fn release_pushes_hands_each_held_page_back_once() {
            let Some((decode, prefill)) = agents("push-release-once") else { return };
            let Linked { decode_region, prefill_region, mut decode_link, mut link } = big_linked(&decode, &prefill, 8);
            let err = push_at_once(&mut link, &prefill_region, &[0, 1, 0, 1], &[0, 1, 2, 3]);
            let held = err.in_flight().to_vec();
            assert_eq!(sorted(held.clone()), vec![0, 1], "{err}");
            assert_eq!(link.in_flight(), vec![(REQ, held.clone())]);
            let released: Vec<u32> = link
                .release_pushes()
                .into_iter()
                .flat_map(|(r, pages)| {
                    assert_eq!(r, REQ);
                    pages
                })
                .collect();
            assert_eq!(sorted(released), vec![0, 1], "each page once");
            assert_eq!((link.in_flight(), link.held_pages(), link.release_pushes()), (vec![], 0, vec![]));
            assert_eq!(link.settle_pushes(), vec![]);
            // The released WRITEs may go on (releasing does not stop them): a later push over the
            // same connection, which polls this agent along, lets them drain before the regions go.
            let pushed = with_live_peer(&mut decode_link, || {
                let src = [Extent { page: 5, len: BIG_PAGE }];
                let deadline = Instant::now() + Duration::from_secs(20);
                let pushed = link.push(&prefill_region, &src, &[PageId(5)], RequestId(3), &[], deadline);
                keep_serving(&mut link, Instant::now() + Duration::from_millis(500), || false);
                pushed
            });
            pushed.unwrap();
            landed_whole(&decode_region, 5..6);
        }

        /// An engine's prefill pages behind an `Arc` it shares with the link as their keep-alive,
        /// so that a test sees when the last share goes (`Weak::strong_count`).
        struct SharedPages(Arc<HostRegion>);

        impl PageRegion for SharedPages {
            fn layout(&self) -> RegionLayout {
                self.0.layout()
            }
            fn page(&self, page: u32, len: u32) -> Result<Cow<'_, [u8]>, NixlError> {
                self.0.bytes(page, len).map(Cow::Borrowed)
            }
            fn scrub(&mut self, _: &[u32]) -> Result<(), NixlError> {
                Err(NixlError::Segment { reason: "prefill's source pages are shared, not scrubbed".to_owned() })
            }
            fn keep_alive(&self) -> Option<KeepAlive> {
                Some(KeepAlive::new(self.0.clone()))
            }
        }

        /// The engine drops the region a failed push's WRITEs still read (its last handle): the
        /// link keeps it registered and allocated, the WRITEs complete from it whole, and it is
        /// freed once `settle_pushes` has handed back its last page. Before, the link kept
        /// nothing: the region was deregistered and freed at the drop while UCX still read it.
        #[test]
        fn a_region_a_held_push_reads_outlives_its_owners_drop_until_its_writes_complete() {
            let Some((decode, prefill)) = agents("push-keep-alive") else { return };
            let Linked { decode_region, prefill_region, mut decode_link, mut link } = big_linked(&decode, &prefill, 4);
            let pages = Arc::new(prefill_region);
            let alive = Arc::downgrade(&pages);
            let err = push_at_once(&mut link, &SharedPages(pages.clone()), &[0, 1, 2, 3], &[0, 1, 2, 3]);
            assert!(!err.in_flight().is_empty(), "{err}");
            drop(pages);
            assert!(alive.strong_count() > 0, "the link keeps the region its held WRITEs read (a share each)");
            with_live_peer(&mut decode_link, || {
                let until = Instant::now() + Duration::from_secs(30);
                while !link.in_flight().is_empty() && Instant::now() < until {
                    link.settle_pushes();
                    std::thread::yield_now();
                }
            });
            assert_eq!(link.in_flight(), vec![], "every WRITE completed");
            assert_eq!(alive.strong_count(), 0, "freed once the last held WRITE completed");
            landed_whole(&decode_region, 0..4);
        }

        // ---- what a staging that failed may still have read: prefill's staged pages -------------

        /// Prefill's progress loop until `done()` (or 30 s): its agent moves along, serving
        /// decode's READs, and the notices that come are kept in its inbox.
        fn serve_until(link: &mut NixlLink<'_>, done: impl Fn(&NixlLink<'_>) -> bool) {
            let until = Instant::now() + Duration::from_secs(30);
            while Instant::now() < until && !done(link) {
                let _ = link.wait(RequestId(777), &[NoticeKind::Released], Instant::now() + Duration::from_millis(5));
            }
        }

        /// Decode pins `expected`'s pages in `table` and pulls them into `decode_region` on a
        /// thread of its own (20 s at most), while prefill's `link` serves until decode is done
        /// and `until(link)`; decode's verdict.
        fn pulled_while_serving(
            decode_link: &mut NixlLink<'_>,
            decode_region: &mut HostRegion,
            table: &OwnershipTable,
            expected: &ExpectedTransfer<'_>,
            link: &mut NixlLink<'_>,
            until: impl Fn(&NixlLink<'_>) -> bool,
        ) -> Result<kvguard::transfer::Accepted, ImportError> {
            let (done_tx, done_rx) = mpsc::channel::<()>();
            std::thread::scope(|s| {
                let decoding = s.spawn(move || {
                    let pinned = Receiver::new(table).pin(expected).unwrap();
                    let deadline = Instant::now() + Duration::from_secs(20);
                    let v = received(decode_link, Direction::Read, pinned, expected, decode_region, deadline);
                    drop(done_tx);
                    v
                });
                serve_until(link, |l| !matches!(done_rx.try_recv(), Err(mpsc::TryRecvError::Empty)) && until(l));
                decoding.join().unwrap()
            })
        }

        /// A staging whose deadline passes before decode released it: decode may still READ the
        /// pages, so the stage reports them (`NixlError::InFlight`, direction Read) and the link
        /// holds them until decode's `Released` naming them comes (`settle_stages`); a decline
        /// of the request does not take that `Released` for its own answer. An engine that
        /// writes the next tenant's KV into each staged page as soon as the library lets it go
        /// never has decode READ that KV. Before, the stage returned a bare timeout and every
        /// page looked free: decode READ the next tenant's KV (refused by its CRC check).
        #[test]
        fn a_stage_that_times_out_holds_its_pages_until_decode_releases_them() {
            const NEXT_TENANTS: u8 = 0xBB;
            let Some((decode, prefill)) = agents("stage-held") else { return };
            let Linked { mut decode_region, mut prefill_region, mut decode_link, mut link } =
                linked(&decode, &prefill, PAGES, PAGE_BYTES);
            let (table, refs) = admitted();
            let expected = expected_for(&refs);
            let (src, manifest) = prefilled(&mut prefill_region, 3, &refs);
            let staged: Vec<u32> = src.iter().map(|e| e.page).collect();
            // Decode's agent is not called yet: its `Released` cannot come by a passed deadline.
            let err = link.stage(&src, REQ, &manifest, Instant::now()).unwrap_err();
            let (held_at_once, settled_at_once) = (link.in_flight(), link.settle_stages());
            // The engine reuses each staged page the library does not hold, at once.
            for &p in staged.iter().filter(|p| !err.in_flight().contains(p)) {
                prefill_region.bytes_mut(p, PAGE_BYTES).unwrap().fill(NEXT_TENANTS);
            }
            // A live prefill (its agent serves decode's READ), not settling yet.
            let verdict =
                pulled_while_serving(&mut decode_link, &mut decode_region, &table, &expected, &mut link, |_| true);
            let accepted = verdict.expect("decode READ the KV staged, not the next tenant's");
            assert_eq!((accepted.tokens(), accepted.pages()), (6, 2));
            assert!(matches!(err.cause(), NixlError::Timeout { .. }), "{err}");
            assert!(matches!(err, NixlError::InFlight { direction: Direction::Read, request: REQ, .. }), "{err}");
            assert_eq!(err.in_flight(), staged.as_slice(), "{err}");
            assert_eq!(held_at_once, vec![(REQ, staged.clone())]);
            assert_eq!(settled_at_once.unwrap(), vec![], "nothing handed back before decode released it");
            // Decode's `Released` (naming the staged extents) is in: a decline does not take it.
            serve_until(&mut link, |l| l.inbox_bytes() > 0);
            let declined = link.decline(REQ, Instant::now() + Duration::from_millis(100));
            assert!(matches!(declined, Err(NixlError::Timeout { .. })), "{declined:?}");
            let mut handed = Vec::new();
            let until = Instant::now() + Duration::from_secs(10);
            while !link.in_flight().is_empty() && Instant::now() < until {
                for (request, pages) in link.settle_stages().unwrap() {
                    assert_eq!(request, REQ);
                    handed.extend(pages);
                }
            }
            assert_eq!(handed, staged, "handed back, once, when decode's Released came");
            assert_eq!(link.in_flight(), vec![]);
            assert_eq!(link.release_stages(), vec![]);
        }

        /// `stage_from`: a staging prefill gave up on keeps the region it staged from while decode
        /// may still READ it. The engine drops its last handle; decode READs the KV from the
        /// kept memory and accepts it; the region is freed once `settle_stages` has handed the
        /// staging back. A staging naming a page outside the region is refused before anything
        /// is sent. (`stage` takes no region: it keeps none.)
        #[test]
        fn a_region_a_held_staging_reads_outlives_its_owners_drop_until_decode_released_it() {
            let Some((decode, prefill)) = agents("stage-keep-alive") else { return };
            let Linked { mut decode_region, mut prefill_region, mut decode_link, mut link } =
                linked(&decode, &prefill, PAGES, PAGE_BYTES);
            let (table, refs) = admitted();
            let expected = expected_for(&refs);
            let (src, manifest) = prefilled(&mut prefill_region, 3, &refs);
            let pages = Arc::new(prefill_region);
            let alive = Arc::downgrade(&pages);
            let outside = [Extent { page: PAGES, len: PAGE_BYTES }];
            let refused = link.stage_from(&SharedPages(pages.clone()), &outside, REQ, &manifest, Instant::now());
            assert!(matches!(refused, Err(NixlError::Extents { .. })), "{refused:?}");
            assert_eq!((link.in_flight(), alive.strong_count()), (vec![], 1), "nothing held, nothing kept");
            // Decode's agent is not called yet: its `Released` cannot come by a passed deadline.
            let err = link.stage_from(&SharedPages(pages.clone()), &src, REQ, &manifest, Instant::now()).unwrap_err();
            assert!(matches!(err, NixlError::InFlight { direction: Direction::Read, request: REQ, .. }), "{err}");
            drop(pages);
            assert_eq!(alive.strong_count(), 1, "the link keeps the region decode may still READ");
            let verdict =
                pulled_while_serving(&mut decode_link, &mut decode_region, &table, &expected, &mut link, |_| true);
            let accepted = verdict.expect("decode READ the KV staged, from the kept region");
            assert_eq!((accepted.tokens(), accepted.pages()), (6, 2));
            let until = Instant::now() + Duration::from_secs(10);
            while !link.in_flight().is_empty() && Instant::now() < until {
                link.settle_stages().unwrap();
            }
            assert_eq!(link.in_flight(), vec![], "decode released the staging");
            assert_eq!(alive.strong_count(), 0, "freed once the staging was handed back");
        }

        /// A staging decode READs too slowly: decode's READ times out (its pages fenced) while
        /// it is still in flight, and prefill's stage timed out before. Prefill holds the staged
        /// pages until decode's READ completed: decode tells it (`Released` naming the staged
        /// extents) when NIXL reports the READ complete and its fence is lifted. Before, prefill
        /// held nothing, and decode sent no `Released` for a READ that outlived its wait.
        #[test]
        fn a_stage_whose_read_outlives_decodes_wait_is_held_until_that_read_completes() {
            let Some((decode, prefill)) = agents("stage-read-fence") else { return };
            let (Pair { mut decode_region, prefill_region: _pr, mut decode_link, prefill_md, decode_layout }, slow) =
                slow_pull(&decode, &prefill);
            let (table, manifest, expected) = (&slow.table, &slow.manifest, slow.expected());
            let mut link = NixlLink::connect(&prefill, &prefill_md, decode_layout).unwrap();
            let src: Vec<Extent> = (0..2).map(|page| Extent { page, len: SLOW_PAGE }).collect();
            let err = link.stage(&src, REQ, manifest, Instant::now()).unwrap_err();
            let (done_tx, done_rx) = mpsc::channel::<()>();
            let (seen_tx, seen_rx) = mpsc::channel::<()>();
            let (still_tx, still_rx) = mpsc::channel::<()>();
            let (go_tx, go_rx) = mpsc::channel::<()>();
            let handed = std::thread::scope(|s| {
                let (table, expected) = (&table, &expected);
                s.spawn(move || {
                    let pinned = Receiver::new(table).pin(expected).unwrap();
                    let until = Instant::now() + Duration::from_secs(10);
                    while decode_link.inbox_bytes() == 0 && Instant::now() < until {
                        let _ = decode_link.wait(RequestId(777), &[], Instant::now() + Duration::from_millis(5));
                    }
                    assert!(decode_link.inbox_bytes() > 0, "prefill staged its pages");
                    // Prefill's agent stands still through decode's 1 ms wait for its READ (over
                    // TCP a READ is served by the agent it reads from): it cannot complete there,
                    // however the threads are scheduled.
                    seen_tx.send(()).unwrap();
                    still_rx.recv_timeout(Duration::from_secs(10)).unwrap();
                    let deadline = Instant::now() + Duration::from_millis(1);
                    let r = received(&mut decode_link, Direction::Read, pinned, expected, &mut decode_region, deadline);
                    let _ = go_tx.send(());
                    assert!(matches!(r, Err(ImportError::Aborted(NixlError::Timeout { .. }))), "{r:?}");
                    assert_eq!(decode_link.fenced(), 1, "the READ still in flight fences decode's pages");
                    let until = Instant::now() + Duration::from_secs(20);
                    while decode_link.fenced() > 0 && Instant::now() < until {
                        decode_link.settle_fences(table, &mut decode_region).unwrap();
                    }
                    assert_eq!(decode_link.fenced(), 0, "the READ completed");
                    // A live decode until prefill is done (or this side panicked).
                    keep_serving(&mut decode_link, Instant::now() + Duration::from_secs(30), || {
                        !matches!(done_rx.try_recv(), Err(mpsc::TryRecvError::Empty))
                    });
                });
                // Prefill's agent moves until decode has the staging, then stands still until
                // decode's wait for its READ has ended.
                let until = Instant::now() + Duration::from_secs(10);
                while matches!(seen_rx.try_recv(), Err(mpsc::TryRecvError::Empty)) && Instant::now() < until {
                    let _ = link.wait(RequestId(777), &[], Instant::now() + Duration::from_millis(1));
                }
                let _ = still_tx.send(());
                let _ = go_rx.recv_timeout(Duration::from_secs(30));
                let mut handed = Vec::new();
                let until = Instant::now() + Duration::from_secs(30);
                while handed.is_empty() && Instant::now() < until {
                    // A live prefill: its agent serves decode's READ.
                    let _ = link.wait(RequestId(777), &[], Instant::now() + Duration::from_millis(1));
                    for (request, pages) in link.settle_stages().unwrap() {
                        // Decode lifts its fence (unpins its pages) once NIXL reports the READ
                        // complete, and only then releases prefill's.
                        assert_eq!(
                            table.snapshot().in_flight,
                            0,
                            "staged pages handed back while decode's READ of them was in flight"
                        );
                        assert_eq!(request, REQ);
                        handed.extend(pages);
                    }
                }
                drop(done_tx);
                handed
            });
            assert_eq!(err.in_flight(), [0, 1].as_slice(), "{err}");
            assert_eq!(handed, vec![0, 1], "handed back once decode's late READ completed");
            assert_eq!(link.in_flight(), vec![]);
        }

        /// A decline's answer (a bare `Released`) that comes late does not end a later staging
        /// of the request: only decode's `Released` naming the staged extents does. Before, it
        /// did: the stage returned at once, its pages looked free while decode had yet to READ
        /// them. A page an earlier staging still holds is not staged again (nothing is sent),
        /// and `release_stages` hands every held staging back when the engine knows decode gone.
        #[test]
        fn a_declines_late_answer_does_not_end_a_staging() {
            let Some((decode, prefill)) = agents("stage-decline") else { return };
            let Linked { mut decode_region, mut prefill_region, mut decode_link, mut link } =
                linked(&decode, &prefill, PAGES, PAGE_BYTES);
            let (table, refs) = admitted();
            let expected = expected_for(&refs);
            // Prefill declines; decode takes the decline only after prefill stopped waiting.
            let declined = link.decline(REQ, Instant::now());
            assert!(matches!(declined, Err(NixlError::Timeout { .. })), "{declined:?}");
            // Prefill serves until the decline's late answer came.
            let r = pulled_while_serving(&mut decode_link, &mut decode_region, &table, &expected, &mut link, |l| {
                l.inbox_bytes() > 0
            });
            assert!(matches!(r, Err(ImportError::Declined)), "{r:?}");
            // Decode is not called now: it cannot READ, nor release, this staging.
            let (src, manifest) = prefilled(&mut prefill_region, 3, &refs);
            let staged: Vec<u32> = src.iter().map(|e| e.page).collect();
            let r = link.stage(&src, REQ, &manifest, Instant::now() + Duration::from_millis(200));
            let err = r.expect_err("a staging ended by a decline's answer: decode has not READ it");
            assert!(matches!(err.cause(), NixlError::Timeout { .. }), "{err}");
            assert_eq!(err.in_flight(), staged.as_slice());
            let again = link.stage(&src[1..], REQ, &manifest, Instant::now() + Duration::from_secs(5));
            assert!(matches!(again, Err(NixlError::Extents { .. })), "{again:?}");
            assert_eq!(link.in_flight(), vec![(REQ, staged.clone())]);
            assert_eq!(link.release_stages(), vec![(REQ, staged)]);
            assert_eq!(link.in_flight(), vec![]);
        }

        /// A pull decode gave up on before prefill staged it (`abandon`): prefill's late staging
        /// is answered by decode's `settle_fences` (`Released` naming its extents; decode never
        /// READs it), so prefill's `settle_stages` hands the pages back without waiting for a
        /// retry of the request. Before, only a later receive of the same request answered it.
        #[test]
        fn a_late_staging_of_a_pull_decode_gave_up_on_is_released_by_its_settle() {
            let Some((decode, prefill)) = agents("stage-abandoned") else { return };
            let Linked { mut decode_region, mut prefill_region, mut decode_link, mut link } =
                linked(&decode, &prefill, PAGES, PAGE_BYTES);
            let (table, refs) = admitted();
            let expected = expected_for(&refs);
            decode_link.expect(REQ);
            let pinned = Receiver::new(&table).pin(&expected).unwrap();
            decode_link.abandon(Direction::Read, pinned);
            let (src, manifest) = prefilled(&mut prefill_region, 3, &refs);
            let err = link.stage(&src, REQ, &manifest, Instant::now()).unwrap_err();
            let staged: Vec<u32> = src.iter().map(|e| e.page).collect();
            assert_eq!(err.in_flight(), staged.as_slice(), "{err}");
            let mut handed = Vec::new();
            let until = Instant::now() + Duration::from_secs(10);
            while handed.is_empty() && Instant::now() < until {
                assert_eq!(decode_link.settle_fences(&table, &mut decode_region).unwrap(), 0);
                for (request, pages) in link.settle_stages().unwrap() {
                    assert_eq!(request, REQ);
                    handed.extend(pages);
                }
            }
            assert_eq!(handed, staged, "decode answered the late staging it will never READ");
            assert_eq!(link.in_flight(), vec![]);
            assert!(table.drain_violations().is_empty());
        }

        /// A push with an extent outside its region (a source page past prefill's, or a
        /// destination past decode's) in its last part posts nothing: every extent is checked
        /// before the first part is posted, and nothing is held. Before, the first parts were
        /// posted, released when the last one failed, and landed in decode's pages anyway.
        #[test]
        fn a_push_with_an_extent_outside_its_region_posts_nothing() {
            let Some((decode, prefill)) = agents("push-outside") else { return };
            let npages = 4u32; // a part each: the first parts would still be moving
            let Linked { decode_region, prefill_region, mut decode_link, mut link } =
                big_linked(&decode, &prefill, npages);
            let src: Vec<Extent> = (0..npages).map(|page| Extent { page, len: BIG_PAGE }).collect();
            let dest: Vec<PageId> = (0..npages).map(PageId).collect();
            let mut outside_src = src.clone();
            outside_src[3].page = npages;
            let mut outside_dest = dest.clone();
            outside_dest[3] = PageId(npages);
            for (src, dest) in [(&outside_src, &dest), (&src, &outside_dest)] {
                let r = link.push(&prefill_region, src, dest, REQ, &[], Instant::now() + Duration::from_secs(5));
                assert!(matches!(r, Err(NixlError::Extents { .. })), "{r:?}");
                assert_eq!(link.in_flight(), vec![]);
            }
            let until = Instant::now() + Duration::from_secs(2);
            std::thread::scope(|s| {
                s.spawn(|| keep_serving(&mut link, until, || false));
                keep_serving(&mut decode_link, until, || false);
            });
            for p in 0..npages {
                assert!(decode_region.bytes(p, BIG_PAGE).unwrap().iter().all(|&b| b == 0), "page {p} was written");
            }
        }
    }
}
