//! A decode step's row write against an engine plugin's mirror of its pool
//! (`kvguard::step::{PoolMirror, decode_writes}`, `OwnershipTable::write_decode_rows`): a page
//! the row's request owns in the mirror is nothing new, a new page of a live row that no prefix
//! holds is claimed once per request and page, anything else is left to the plugin in order;
//! the claims judge as the same claims made one by one, and the mirror then says what the table
//! says. Bad arrays are typed errors that change nothing.

use crate::model::mirror as model;
use kvguard::step::{DecodeRowWrite, MirrorError, PoolMirror, decode_writes};
use kvguard::{OwnershipTable, PageId, Policy, PoolConfig, RequestId, TenantId, ViolationKind};
use proptest::prelude::*;

const PAGES: u32 = 12;

fn table(ps: u32) -> OwnershipTable {
    let t = OwnershipTable::new(PoolConfig::new(PAGES, ps, 8).with_reserved([PageId(0)]).with_policy(Policy::Enforce))
        .expect("the test pool passes its audit");
    for key in 1..=3 {
        t.admit(RequestId(key), TenantId(key % 2), 4, 4).expect("admit");
    }
    t
}

/// A mirror of `PAGES` pages whose rows 0, 1 and 2 are requests 1, 2 and 3 (live, claiming), no
/// page owned or a prefix.
struct Mirror {
    keys: Vec<i64>,
    claimants: Vec<i64>,
    prefix: Vec<i64>,
    owner: Vec<i64>,
    checked: Vec<i64>,
}

impl Mirror {
    fn new() -> Mirror {
        Mirror {
            keys: vec![1, 2, 3],
            claimants: vec![1, 1, 1],
            prefix: vec![0; PAGES as usize + 1],
            owner: vec![0; PAGES as usize + 1],
            checked: vec![40, 40, 40],
        }
    }

    /// `write_decode_rows` of positions (row, column, slot) on `t`.
    fn write(
        &mut self,
        t: &OwnershipTable,
        pos: &[(u64, i64, i64)],
    ) -> Result<kvguard::step::RowWriteOutcome, MirrorError> {
        let rows: Vec<u64> = pos.iter().map(|p| p.0).collect();
        let cols: Vec<i64> = pos.iter().map(|p| p.1).collect();
        let slots: Vec<i64> = pos.iter().map(|p| p.2).collect();
        let mirror = PoolMirror::new(&self.keys[..], &self.claimants[..], &self.prefix[..], &self.owner[..], PAGES)?;
        let write = DecodeRowWrite { rows: &rows, cols: &cols[..], slots: &slots[..] };
        t.write_decode_rows(mirror, &mut self.owner[..], &mut self.checked[..], write)
    }
}

#[test]
fn a_slot_in_a_page_the_row_already_owns_claims_nothing() {
    let t = table(4);
    t.claim(RequestId(1), &[PageId(3)]).expect("claim");
    let mut m = Mirror::new();
    m.owner[3] = 1;
    let out = m.write(&t, &[(0, 13, 13)]).expect("a well-formed write");
    assert!(out.is_clean() && out.claims.is_empty());
}

#[test]
fn a_new_page_of_a_live_row_is_claimed_and_the_mirror_says_so() {
    let t = table(4);
    let mut m = Mirror::new();
    let out = m.write(&t, &[(1, 20, 4 * 5 + 2)]).expect("a well-formed write");
    assert!(out.is_clean());
    assert_eq!(out.claims.len(), 1);
    assert_eq!((out.claims[0].request, out.claims[0].page), (RequestId(2), PageId(5)));
    assert_eq!((out.claims[0].at(PAGES as usize), out.claims[0].position), (5, 0));
    assert_eq!(m.owner[5], 2, "page_owner follows the grant");
    assert_eq!(t.page_info(PageId(5)).expect("in the pool").owner, Some(RequestId(2)));
    assert_eq!(m.checked, [40, 20, 40], "the row's checked length drops to the column written");
}

#[test]
fn two_positions_of_one_row_in_one_new_page_claim_it_once() {
    let t = table(4);
    let mut m = Mirror::new();
    let out = m.write(&t, &[(0, 8, 8), (0, 9, 9), (2, 8, 4 * 7)]).expect("a well-formed write");
    assert!(out.is_clean());
    let claimed: Vec<_> = out.claims.iter().map(|c| (c.request, c.page)).collect();
    assert_eq!(claimed, [(RequestId(1), PageId(2)), (RequestId(3), PageId(7))]);
}

#[test]
fn a_row_of_no_live_request_or_a_prefix_page_is_left_to_the_plugin_in_order() {
    let t = table(4);
    let mut m = Mirror::new();
    m.claimants[1] = 0;
    m.prefix[6] = 9;
    let out = m.write(&t, &[(0, 0, 4 * 6), (1, 0, 4 * 8), (2, 0, 4 * 9)]).expect("a well-formed write");
    assert_eq!(out.left, [0, 1]);
    assert_eq!(out.claims.len(), 1, "only row 2's page is claimed");
    assert!(!out.is_clean());
    assert_eq!(m.owner[6], 0);
    assert_eq!(m.owner[8], 0);
}

#[test]
fn a_page_another_request_holds_is_refused_and_the_mirror_is_not_told_it_was_granted() {
    let t = table(4);
    t.claim(RequestId(1), &[PageId(4)]).expect("claim");
    let mut m = Mirror::new(); // a stale mirror: page 4 looks free
    let out = m.write(&t, &[(1, 0, 4 * 4), (2, 0, 4 * 10)]).expect("a well-formed write");
    let refused: Vec<_> = out.verdict.refused.iter().map(|(i, v)| (*i, v.kind())).collect();
    assert_eq!(refused, [(0, ViolationKind::PageNotFree)]);
    assert_eq!(m.owner[4], 0, "the refused claim is not written");
    assert_eq!(m.owner[10], 3, "the granted one is");
}

#[test]
fn a_slot_outside_the_pool_is_claimed_so_the_table_refuses_it_and_no_page_is_marked() {
    let t = table(4);
    let mut m = Mirror::new();
    // The last entry stands for every page out of range, whatever it holds.
    m.owner[PAGES as usize] = 1;
    let out = m.write(&t, &[(0, 0, -1), (0, 1, i64::from(PAGES) * 4 + 3)]).expect("a well-formed write");
    assert_eq!(out.claims.len(), 2);
    // Both name the mirror's last entry (slot -1 floors to no page at all).
    assert!(out.claims.iter().all(|c| c.at(PAGES as usize) == PAGES as usize), "{:?}", out.claims);
    assert!(out.verdict.refused.iter().all(|(_, v)| v.kind() == ViolationKind::PageOutOfRange));
    assert_eq!(out.verdict.refused.len(), 2);
    assert_eq!(m.owner[PAGES as usize], 1, "nothing is written to the out-of-range entry");
}

#[test]
fn bad_arrays_are_typed_errors_that_change_nothing() {
    let t = table(4);
    let mut m = Mirror::new();
    let err = |e: MirrorError| e.to_string();
    let m2 = |f: &dyn Fn(&mut Mirror)| {
        let mut m = Mirror::new();
        f(&mut m);
        m
    };
    let mut short = m2(&|m| m.claimants.pop().map(drop).unwrap_or(()));
    assert!(err(short.write(&t, &[(0, 0, 8)]).expect_err("short")).contains("row_claimants"));
    let mut pages = m2(&|m| m.prefix.push(0));
    assert!(err(pages.write(&t, &[(0, 0, 8)]).expect_err("long")).contains("page_prefix"));
    let mut checked = m2(&|m| m.checked.push(0));
    assert!(err(checked.write(&t, &[(0, 0, 8)]).expect_err("long")).contains("row_checked"));
    assert!(matches!(m.write(&t, &[(3, 0, 8)]), Err(MirrorError::Row { index: 0, row: 3, row_keys: 3 })));
    // cols of two entries for three positions
    let mirror = PoolMirror::new(&m.keys[..], &m.claimants[..], &m.prefix[..], &m.owner[..], PAGES).expect("fits");
    let bad = DecodeRowWrite { rows: &[0, 1, 2], cols: &[1i64, 2][..], slots: &[8i64, 9, 10][..] };
    assert!(matches!(
        t.write_decode_rows(mirror, &mut m.owner.clone()[..], &mut m.checked.clone()[..], bad),
        Err(MirrorError::Positions { name: "cols", .. })
    ));
    let mirror = PoolMirror::new(&m.keys[..], &m.claimants[..], &m.prefix[..], &m.owner[..], PAGES).expect("fits");
    assert!(matches!(
        decode_writes(mirror, &m.owner[..], &[0, 1], &[8i64][..], 4),
        Err(MirrorError::Positions { name: "slots", .. })
    ));
    assert_eq!(m.owner, Mirror::new().owner);
    assert_eq!(m.checked, Mirror::new().checked);
    assert!(t.page_info(PageId(2)).expect("in the pool").owner.is_none(), "nothing was claimed");
}

/// A mirror drawn over three requests (and keys no request has), some pages claimed in the
/// table first and the mirror right or wrong about them, and a row write's positions.
#[derive(Clone, Debug)]
struct Drawn {
    ps: u32,
    keys: Vec<i64>,
    claimants: Vec<i64>,
    prefix: Vec<i64>,
    owner: Vec<i64>,
    claimed: Vec<(u64, u32)>,
    positions: Vec<(u64, i64, i64)>,
}

fn drawn() -> impl Strategy<Value = Drawn> {
    let pages = PAGES as usize + 1;
    (
        prop_oneof![Just(1u32), Just(4u32)],
        prop::collection::vec(prop_oneof![4 => 1i64..=3, 1 => Just(0i64), 1 => Just(77i64)], 4),
        prop::collection::vec(prop_oneof![4 => Just(1i64), 1 => Just(0i64)], 4),
        prop::collection::vec(prop_oneof![5 => Just(0i64), 1 => Just(5i64)], pages),
        prop::collection::vec(prop_oneof![3 => Just(0i64), 1 => 1i64..=3], pages),
        prop::collection::vec((1u64..=3, 1u32..PAGES), 0..6),
        prop::collection::vec((0u64..4, -2i64..60, -6i64..(PAGES as i64 * 4 + 6)), 0..10),
    )
        .prop_map(|(ps, keys, claimants, prefix, owner, claimed, positions)| Drawn {
            ps,
            keys,
            claimants,
            prefix,
            owner,
            claimed,
            positions,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// The row write sorts each position by the mirror's rule, its claims judge as the same
    /// claims made one by one, and the mirror and the table end as they say.
    #[test]
    fn a_row_write_judges_as_its_claims_one_by_one(d in drawn()) {
        let (one, two) = (table(d.ps), table(d.ps));
        for &(key, page) in &d.claimed {
            let _ = one.claim(RequestId(key), &[PageId(page)]);
            let _ = two.claim(RequestId(key), &[PageId(page)]);
        }
        let positions = d
            .positions
            .iter()
            .map(|&(row, col, slot)| (row, col, slot.clamp(-1, i64::from(PAGES) * i64::from(d.ps) + 3)))
            .collect();
        let m = model::Mirror {
            keys: d.keys,
            claimants: d.claimants,
            prefix: d.prefix,
            owner: d.owner,
            checked: vec![30; 4],
            positions,
        };
        model::row_write_as_its_claims(&one, &two, &m, "drawn");
    }
}

#[test]
fn the_mirror_updated_with_arrays_sort_never_saw_changes_less_and_never_panics() {
    let t = table(4);
    let m = Mirror::new();
    let (rows, cols, slots) = ([0u64, 2], [5i64, 6], [4 * 5, 4 * 6]);
    let write = DecodeRowWrite { rows: &rows, cols: &cols[..], slots: &slots[..] };
    let mirror = PoolMirror::new(&m.keys[..], &m.claimants[..], &m.prefix[..], &m.owner[..], PAGES).expect("fits");
    let writes = write.sort(mirror, &m.owner[..], m.checked.len(), 4).expect("well formed");
    let verdict = t.claim_decode(&writes);
    assert!(verdict.is_clean());
    // Arrays of one entry each, and none at all: nothing past them is written.
    let (mut owner, mut checked) = (vec![0i64; 1], vec![40i64; 1]);
    write.update_mirror(&writes, &verdict, &mut owner[..], &mut checked[..]);
    assert_eq!((owner, checked), (vec![0], vec![5]));
    let (mut owner, mut checked): (Vec<i64>, Vec<i64>) = (Vec::new(), Vec::new());
    write.update_mirror(&writes, &verdict, &mut owner[..], &mut checked[..]);
    assert!(owner.is_empty() && checked.is_empty());
}
