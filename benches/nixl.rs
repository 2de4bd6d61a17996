//! Throughput of a prefill→decode transfer over NIXL on loopback (UCX TCP), with and without
//! kvguard's checks, in the same run: `transfer_nixl/unchecked/SIZE` is NIXL alone (prefill
//! WRITEs the pages in one transfer with a notification, decode waits for it);
//! `transfer_nixl/checked/SIZE` adds everything kvguard does, in series, as a link does by
//! default (prefill builds the manifest: a CRC32 per page, and [`NixlLink::push`]es it in one
//! WRITE; decode pins, decodes the manifest, checks it and every page's length and CRC32,
//! records coverage, releases); `transfer_nixl/overlapped/SIZE` is the same with the sender's
//! CRCs taken ahead and parts on: prefill checksums its pages one by one while decode pins and
//! sends its offer, and stops at the offer ([`NixlLink::push_prompt_ahead`]); the rest go as
//! [`NixlLink::push_prompt`] does with parts ([`NixlLink::set_parts`]: each side checksums a
//! part's pages as the part is posted or lands, while the other parts fly).
//! The pull direction the same way: `transfer_nixl/pull_unchecked/SIZE` is NIXL alone with the
//! protocol's two notifications (prefill says the pages are staged, decode READs them and says
//! it released them); `transfer_nixl/pull_checked/SIZE` is [`NixlLink::stage`] with the manifest
//! and decode's [`NixlLink::receive`] of a READ (pin, READ, checks, coverage, release).
//! 64 KiB pages (32 per transfer) and 2 MiB pages (8 per transfer). Goal: checked ≥ 0.9 of
//! unchecked, both directions.
//!
//! `cargo bench --features nixl --bench nixl` with `libnixl_capi.so` on `LD_LIBRARY_PATH`
//! (`source scripts/ci/nixl.sh setup`). Prints one line per row, the ratio per size, and where
//! the checked transfer's time goes (`transfer_nixl/pieces/SIZE`: medians of each piece, timed
//! from both threads' timestamps: decode's admit and pin, prefill's CRCs and manifest, NIXL's
//! WRITE, decode after prefill saw the WRITE complete — the notification, the CRCs of the
//! landed bytes, the checks, coverage — and the release), next to the unchecked transfer.

use kvguard::transfer::nixl::{
    Direction, Extent, HostRegion, NixlAgent, NixlLink, Notice, NoticeKind, PART_BYTES, library_available,
};
use kvguard::transfer::{ExpectedTransfer, Manifest, Receiver, SenderId, TransferHeader, page_checksum};
use kvguard::{Generation, OwnershipTable, PageId, PageRef, PoolConfig, RequestId, TenantId};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const TOKENS_PER_PAGE: u32 = 16;
const ROUNDS: usize = 7;

fn main() {
    if !library_available() {
        eprintln!("transfer_nixl: libnixl_capi.so not loadable (source scripts/ci/nixl.sh setup); nothing measured");
        return;
    }
    // Filters from `cargo bench -- NAME` are ignored: the rows only mean something together.
    for (page_bytes, pages) in [(64u32 << 10, 32u32), (2u32 << 20, 8)] {
        let m = measure(page_bytes, pages);
        let label =
            if page_bytes >= 1 << 20 { format!("{}MiB", page_bytes >> 20) } else { format!("{}KiB", page_bytes >> 10) };
        println!("transfer_nixl/unchecked/{label}  {:>8.1} MiB/s (median transfer)", m.unchecked);
        println!("transfer_nixl/checked/{label}    {:>8.1} MiB/s (median transfer)", m.checked);
        println!("transfer_nixl/overlapped/{label} {:>8.1} MiB/s (median transfer)", m.overlapped);
        println!("transfer_nixl/pull_unchecked/{label} {:>8.1} MiB/s (median transfer)", m.pull_unchecked);
        println!("transfer_nixl/pull_checked/{label}   {:>8.1} MiB/s (median transfer)", m.pull_checked);
        let [pin, sums, write, landed, release] = m.pieces;
        println!(
            "transfer_nixl/pieces/{label} checked: pin {pin:.0} us, prefill CRCs + manifest {sums:.0} us, WRITE {write:.0} us, \
             decode after the WRITE (notification, CRCs, checks, coverage) {landed:.0} us, release {release:.0} us; \
             unchecked transfer {:.0} us",
            m.unchecked_us
        );
        for (row, ratio, [lo, mid, hi]) in [
            ("ratio", m.ratio, m.round_ratios),
            ("ratio_overlapped", m.ratio_overlapped, m.round_ratios_overlapped),
            ("ratio_pull", m.ratio_pull, m.round_ratios_pull),
        ] {
            println!(
                "transfer_nixl/{row}/{label} {ratio:>8.3} (/ unchecked, median of pairs; rounds min {lo:.3} median {mid:.3} max {hi:.3}; goal >= 0.9)"
            );
        }
    }
}

/// What [`measure`] found.
struct Measured {
    /// Throughput (MiB/s) of the median unchecked transfer.
    unchecked: f64,
    /// Throughput (MiB/s) of the median checked transfer.
    checked: f64,
    /// Throughput (MiB/s) of the median overlapped transfer.
    overlapped: f64,
    /// Median over adjacent (unchecked, checked) pairs of unchecked time / checked time.
    ratio: f64,
    /// Min, median and max over rounds of that ratio's per-round median.
    round_ratios: [f64; 3],
    /// As `ratio`, for the overlapped transfers.
    ratio_overlapped: f64,
    /// As `round_ratios`, for the overlapped transfers.
    round_ratios_overlapped: [f64; 3],
    /// Throughput (MiB/s) of the median unchecked pull.
    pull_unchecked: f64,
    /// Throughput (MiB/s) of the median checked pull.
    pull_checked: f64,
    /// As `ratio`, for the (unchecked, checked) pulls.
    ratio_pull: f64,
    /// As `round_ratios`, for the pulls.
    round_ratios_pull: [f64; 3],
    /// Medians (µs) of the checked transfer's pieces: decode's admit and pin; prefill's CRCs
    /// and manifest; the WRITE; decode from the WRITE's completion to its verdict; the release
    /// and the hand-back to prefill.
    pieces: [f64; 5],
    /// The median unchecked transfer, µs.
    unchecked_us: f64,
}

/// Min, median and max.
fn spread(mut values: Vec<f64>) -> [f64; 3] {
    values.sort_by(f64::total_cmp);
    [values[0], values[values.len() / 2], values[values.len() - 1]]
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The modes of one round, in the order they run: pushes unchecked, checked and overlapped,
/// then pulls unchecked and checked.
const MODES: usize = 5;
const PUSH_UNCHECKED: usize = 0;
const PUSH_CHECKED: usize = 1;
const PULL_UNCHECKED: usize = 3;
const PULL_CHECKED: usize = 4;

/// Pushes unchecked, checked and overlapped, then pulls unchecked and checked, interleaved one
/// by one (so the load on a shared machine hits all alike), timed each; ratios taken over
/// adjacent runs.
fn measure(page_bytes: u32, pages: u32) -> Measured {
    let slot_bytes = page_bytes / TOKENS_PER_PAGE;
    let tokens = pages * TOKENS_PER_PAGE;
    let prompt: Vec<u32> = (0..tokens).collect();
    let prefill = NixlAgent::new(&format!("bench-prefill-{page_bytes}")).expect("prefill agent");
    let decode = NixlAgent::new(&format!("bench-decode-{page_bytes}")).expect("decode agent");
    let mut src_region = HostRegion::new(&prefill, pages, page_bytes).expect("prefill region");
    let mut dst_region = HostRegion::new(&decode, pages, page_bytes).expect("decode region");
    for p in 0..pages {
        for (i, b) in src_region.bytes_mut(p, page_bytes).unwrap().iter_mut().enumerate() {
            *b = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(p) as u8;
        }
    }
    let (prefill_md, decode_md) = (prefill.metadata().unwrap(), decode.metadata().unwrap());
    let (src_layout, dst_layout) = (src_region.layout(), dst_region.layout());
    let per_transfer = f64::from(pages) * f64::from(page_bytes) / f64::from(1u32 << 20);
    let iters = (128.0 / per_transfer).ceil() as u64; // ~128 MiB per round and mode

    let (go, jobs) = mpsc::channel::<Option<(usize, u64)>>();
    // Decode → prefill: the pinned pages (the pull), then "received".
    let (done, finished) = mpsc::channel::<Vec<PageRef>>();
    // Decode → prefill, checked transfers: when the pages were pinned and the verdict came.
    let (stamp, stamps) = mpsc::channel::<[Instant; 2]>();
    let mut pieces: [Vec<f64>; 5] = Default::default();
    let mut times: [Vec<f64>; MODES] = Default::default();
    let (mut pair_ratios, mut round_ratios): ([Vec<f64>; 3], [Vec<f64>; 3]) = Default::default();
    std::thread::scope(|s| {
        let decode = &decode;
        let dst_region = &mut dst_region;
        let prompt = &prompt;
        s.spawn(move || {
            let mut link = NixlLink::connect(decode, &prefill_md, src_layout).unwrap();
            let table = OwnershipTable::new(PoolConfig::new(pages, TOKENS_PER_PAGE, u64::from(tokens))).unwrap();
            while let Ok(Some((mode, request))) = jobs.recv() {
                let req = RequestId(request);
                let deadline = Instant::now() + Duration::from_secs(30);
                if mode == PULL_UNCHECKED {
                    // NIXL alone: prefill's word that the pages are staged, one READ, decode's word
                    // that it is done with them.
                    let refs: Vec<PageRef> =
                        (0..pages).map(|p| PageRef { page: PageId(p), generation: Generation(0) }).collect();
                    done.send(refs).unwrap();
                    let staged = link.wait(req, &[NoticeKind::Staged], deadline).unwrap();
                    let into: Vec<Extent> = (0..pages).map(|page| Extent { page, len: page_bytes }).collect();
                    decode
                        .transfer(
                            Direction::Read,
                            &dst_region.layout(),
                            &into,
                            link.peer(),
                            &link.peer_region(),
                            &staged.extents,
                            None,
                            deadline,
                        )
                        .unwrap();
                    link.send(&Notice::bare(NoticeKind::Released, req)).unwrap();
                } else if mode != PUSH_UNCHECKED {
                    table.admit(req, TenantId(1), u64::from(tokens), 0).unwrap();
                    let refs = table.allocate(req, pages).unwrap();
                    let expected =
                        ExpectedTransfer::for_prompt(req, TenantId(1), prompt, &refs, TOKENS_PER_PAGE, slot_bytes);
                    let pinned = Receiver::new(&table).pin(&expected).unwrap();
                    let pinned_at = Instant::now();
                    link.expect(req); // decode's link is selective: before the peer may send
                    done.send(refs.clone()).unwrap(); // pinned: prefill may write (or stage)
                    let direction = if mode == PULL_CHECKED { Direction::Read } else { Direction::Write };
                    link.receive(direction, pinned, &expected, dst_region, deadline, |_, _, _| Ok(())).unwrap();
                    stamp.send([pinned_at, Instant::now()]).unwrap();
                    table.release(req).unwrap();
                } else {
                    done.send((0..pages).map(|p| PageRef { page: PageId(p), generation: Generation(0) }).collect())
                        .unwrap();
                    link.wait(req, &[NoticeKind::Written], deadline).unwrap();
                }
                done.send(Vec::new()).unwrap();
            }
        });
        let mut link = NixlLink::connect(&prefill, &decode_md, dst_layout).unwrap();
        let src: Vec<Extent> = (0..pages).map(|page| Extent { page, len: page_bytes }).collect();
        let mut request = 0u64;
        for _ in 0..ROUNDS {
            let mut round: [Vec<f64>; 3] = Default::default();
            for _ in 0..iters {
                let mut pair = [0.0f64; MODES];
                for mode in 0..MODES {
                    let start = Instant::now();
                    request += 1;
                    go.send(Some((mode, request))).unwrap();
                    // Overlapped: prefill checksums its pages while decode pins and offers.
                    let mut ahead: Vec<(usize, u32)> = Vec::new();
                    let offer = if mode == 2 {
                        loop {
                            if let Ok(offer) = finished.try_recv() {
                                break offer;
                            }
                            if ahead.len() < src.len() {
                                let page = src_region.bytes(src[ahead.len()].page, page_bytes).unwrap();
                                ahead.push((page.len(), page_checksum(page)));
                            } else {
                                break finished.recv().unwrap();
                            }
                        }
                    } else {
                        finished.recv().unwrap()
                    };
                    let dest_refs = offer;
                    let dest: Vec<PageId> = dest_refs.iter().map(|r| r.page).collect();
                    let deadline = Instant::now() + Duration::from_secs(30);
                    if mode == PULL_UNCHECKED {
                        link.send(&Notice {
                            extents: src.clone(),
                            ..Notice::bare(NoticeKind::Staged, RequestId(request))
                        })
                        .unwrap();
                        link.wait(RequestId(request), &[NoticeKind::Released], deadline).unwrap();
                        finished.recv().unwrap();
                        pair[mode] = start.elapsed().as_secs_f64();
                        continue;
                    }
                    if mode == PUSH_UNCHECKED {
                        // NIXL alone: one WRITE of every page, one notification.
                        let written: Vec<Extent> = dest.iter().map(|d| Extent { page: d.0, len: page_bytes }).collect();
                        let notice = Notice::bare(NoticeKind::Written, RequestId(request)).encode();
                        prefill
                            .transfer(
                                Direction::Write,
                                &src_region.layout(),
                                &src,
                                link.peer(),
                                &dst_layout,
                                &written,
                                Some(&notice),
                                deadline,
                            )
                            .unwrap();
                        finished.recv().unwrap();
                        pair[0] = start.elapsed().as_secs_f64();
                        continue;
                    }
                    let header = TransferHeader {
                        request: RequestId(request),
                        tenant: TenantId(1),
                        sender: SenderId(1),
                        page_size: TOKENS_PER_PAGE,
                        slot_bytes,
                    };
                    let refs_at = Instant::now();
                    let mut sent = [refs_at; 2];
                    if mode == PULL_CHECKED {
                        let bytes: Vec<&[u8]> = (0..pages).map(|p| src_region.bytes(p, page_bytes).unwrap()).collect();
                        let manifest = Manifest::build(header, prompt, &dest_refs, &bytes).unwrap().encode();
                        link.stage(&src, RequestId(request), &manifest, deadline).unwrap();
                    } else if mode == PUSH_CHECKED {
                        link.set_parts(None);
                        let bytes: Vec<&[u8]> = (0..pages).map(|p| src_region.bytes(p, page_bytes).unwrap()).collect();
                        let manifest = Manifest::build(header, prompt, &dest_refs, &bytes).unwrap().encode();
                        sent[0] = Instant::now();
                        link.push(&src_region, &src, &dest, RequestId(request), &manifest, deadline).unwrap();
                        sent[1] = Instant::now();
                    } else {
                        link.set_parts(Some(PART_BYTES));
                        link.push_prompt_ahead(&src_region, &src, header, prompt, &dest_refs, &ahead, deadline)
                            .unwrap();
                    }
                    finished.recv().unwrap();
                    let end = Instant::now();
                    pair[mode] = (end - start).as_secs_f64();
                    let [pinned_at, verdict_at] = stamps.recv().unwrap();
                    if mode == PUSH_CHECKED {
                        let marks = [start, pinned_at.max(start), sent[0], sent[1], verdict_at.max(sent[1]), end];
                        for (k, piece) in pieces.iter_mut().enumerate() {
                            piece.push(marks[k + 1].saturating_duration_since(marks[k]).as_secs_f64() * 1e6);
                        }
                    }
                }
                for (mode, t) in pair.iter().enumerate() {
                    times[mode].push(*t);
                }
                round[0].push(pair[0] / pair[1]);
                round[1].push(pair[0] / pair[2]);
                round[2].push(pair[PULL_UNCHECKED] / pair[PULL_CHECKED]);
            }
            for k in 0..3 {
                pair_ratios[k].extend_from_slice(&round[k]);
                round_ratios[k].push(median(&mut round[k]));
            }
        }
        go.send(None).unwrap();
    });
    let [t0, t1, t2, t3, t4] = &mut times;
    Measured {
        unchecked: per_transfer / median(t0),
        checked: per_transfer / median(t1),
        overlapped: per_transfer / median(t2),
        ratio: median(&mut pair_ratios[0]),
        round_ratios: spread(std::mem::take(&mut round_ratios[0])),
        ratio_overlapped: median(&mut pair_ratios[1]),
        round_ratios_overlapped: spread(std::mem::take(&mut round_ratios[1])),
        pull_unchecked: per_transfer / median(t3),
        pull_checked: per_transfer / median(t4),
        ratio_pull: median(&mut pair_ratios[2]),
        round_ratios_pull: spread(std::mem::take(&mut round_ratios[2])),
        pieces: pieces.map(|mut p| median(&mut p)),
        unchecked_us: median(t0) * 1e6,
    }
}
